/* gw-plot.c -- SVG line charts: ranges, ticks, polylines, legend. */
#include "gw-plot.h"

#include <math.h>
#include <stdbool.h>

#include "status.h"

#define W 720.0
#define H 420.0
#define ML 70.0 /* margins: left, right, top, bottom */
#define MR 24.0
#define MT 44.0
#define MB 56.0

/* The data's bounds, and where a value lands on the canvas. */
typedef struct gw_frame {
    double x0, x1, y0, y1;
    bool empty;
} gw_frame;

static double gw_px(const gw_frame *f, double x) { return ML + (x - f->x0) / (f->x1 - f->x0) * (W - ML - MR); }
static double gw_py(const gw_frame *f, double y) { return H - MB - (y - f->y0) / (f->y1 - f->y0) * (H - MT - MB); }

/* The bounds of every finite point, widened so that no span is empty and lines clear the frame. */
static gw_frame gw_frame_of(const gw_plot_series *s, int n) {
    gw_frame f = {INFINITY, -INFINITY, INFINITY, -INFINITY, true};
    for (int i = 0; i < n; i++)
        for (size_t k = 0; k < s[i].n; k++) {
            if (!isfinite(s[i].x[k]) || !isfinite(s[i].y[k])) continue;
            f.x0 = fmin(f.x0, s[i].x[k]), f.x1 = fmax(f.x1, s[i].x[k]);
            f.y0 = fmin(f.y0, s[i].y[k]), f.y1 = fmax(f.y1, s[i].y[k]);
            f.empty = false;
        }
    if (f.empty) return (gw_frame){0, 1, 0, 1, true};
    if (f.x1 <= f.x0) f.x0 -= 0.5, f.x1 += 0.5;
    double pad = (f.y1 - f.y0) * 0.05;
    if (pad <= 0) pad = fabs(f.y0) * 0.05 + 0.5;
    f.y0 -= pad, f.y1 += pad;
    return f;
}

/* A round tick step (1, 2 or 5 x 10^k) giving about 6 ticks over span. */
static double gw_tick_step(double span) {
    double raw = span / 6, p = pow(10, floor(log10(raw))), m = raw / p;
    return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p;
}

/* Appends text XML-escaped. */
static int gw_xml_text(fu_buf *out, const char *s) {
    int rc = FU_OK;
    for (; s && *s && !rc; s++) {
        const char *e = *s == '<' ? "&lt;" : *s == '>' ? "&gt;" : *s == '&' ? "&amp;" : *s == '"' ? "&quot;" : NULL;
        rc = e ? fu_buf_appendf(out, "%s", e) : fu_buf_append(out, s, 1);
    }
    return rc;
}

/* Gridlines and tick labels of both axes. */
static int gw_plot_ticks(const gw_frame *f, fu_buf *out) {
    int rc = FU_OK;
    double sx = gw_tick_step(f->x1 - f->x0), sy = gw_tick_step(f->y1 - f->y0);
    for (double x = ceil(f->x0 / sx) * sx; x <= f->x1 + sx * 1e-9 && !rc; x += sx)
        rc = fu_buf_appendf(out, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e4e4e4\"/>"
                                 "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n",
                            gw_px(f, x), MT, gw_px(f, x), H - MB, gw_px(f, x), H - MB + 18, x);
    for (double y = ceil(f->y0 / sy) * sy; y <= f->y1 + sy * 1e-9 && !rc; y += sy)
        rc = fu_buf_appendf(out, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e4e4e4\"/>"
                                 "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
                            ML, gw_py(f, y), W - MR, gw_py(f, y), ML - 6, gw_py(f, y) + 4, fabs(y) < sy * 1e-9 ? 0 : y);
    return rc;
}

/* One series: its polyline (or a dot for a lone point) and its legend entry (the i-th). */
static int gw_plot_series_svg(const gw_frame *f, const gw_plot_series *s, int i, fu_buf *out) {
    size_t shown = 0, last = 0;
    int rc = fu_buf_appendf(out, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" points=\"", s->color);
    for (size_t k = 0; k < s->n && !rc; k++) {
        if (!isfinite(s->x[k]) || !isfinite(s->y[k])) continue;
        rc = fu_buf_appendf(out, "%.1f,%.1f ", gw_px(f, s->x[k]), gw_py(f, s->y[k]));
        shown++, last = k;
    }
    if (!rc) rc = fu_buf_appendf(out, "\"/>\n");
    if (!rc && shown == 1)
        rc = fu_buf_appendf(out, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n", gw_px(f, s->x[last]),
                            gw_py(f, s->y[last]), s->color);
    const double ly = MT + 8 + 18.0 * i;
    if (!rc) rc = fu_buf_appendf(out, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                                      "stroke-width=\"3\"/><text x=\"%.1f\" y=\"%.1f\">", W - MR - 150, ly,
                                 W - MR - 128, ly, s->color, W - MR - 122, ly + 4);
    if (!rc) rc = gw_xml_text(out, s->name);
    return rc ? rc : fu_buf_appendf(out, "</text>\n");
}

/* The document's head: canvas, title, axis titles, frame. */
static int gw_plot_head(const char *title, const char *x_label, const char *y_label, fu_buf *out) {
    int rc = fu_buf_appendf(out, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" "
                                 "width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" "
                                 "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
                                 "<text x=\"%.1f\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">",
                            W, H, W, H, W / 2);
    if (!rc) rc = gw_xml_text(out, title);
    if (!rc) rc = fu_buf_appendf(out, "</text>\n<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">", (W + ML - MR) / 2, H - 14);
    if (!rc) rc = gw_xml_text(out, x_label);
    if (!rc) rc = fu_buf_appendf(out, "</text>\n<text transform=\"translate(18 %.1f) rotate(-90)\" text-anchor=\"middle\">",
                                 (H + MT - MB) / 2);
    if (!rc) rc = gw_xml_text(out, y_label);
    return rc ? rc : fu_buf_appendf(out, "</text>\n");
}

int gw_plot_svg(const char *title, const char *x_label, const char *y_label, const gw_plot_series *series,
                int n_series, fu_buf *out) {
    const gw_frame f = gw_frame_of(series, n_series);
    int rc = gw_plot_head(title, x_label, y_label, out);
    if (!rc) rc = gw_plot_ticks(&f, out);
    if (!rc) rc = fu_buf_appendf(out, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
                                      "stroke=\"#444\"/>\n", ML, MT, W - ML - MR, H - MT - MB);
    if (!rc && f.empty)
        rc = fu_buf_appendf(out, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">no data</text>\n",
                            (W + ML - MR) / 2, (H + MT - MB) / 2);
    for (int i = 0; i < n_series && !rc && !f.empty; i++) rc = gw_plot_series_svg(&f, &series[i], i, out);
    if (!rc) rc = fu_buf_appendf(out, "</svg>\n");
    return rc ? fu_errorf(FU_ERR_NOMEM, "chart") : FU_OK;
}
