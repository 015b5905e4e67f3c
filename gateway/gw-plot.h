/* gw-plot.h -- a line chart as one self-contained SVG document: the loss curves of a fine-tuning job.
 *
 * No scripts, fonts or references outside the document: it opens in any
 * browser or image viewer. Threading: pure functions. Ownership: the series
 * are borrowed; the document is appended to the caller's buffer.
 */
#ifndef FU_GW_PLOT_H
#define FU_GW_PLOT_H

#include <stddef.h>

#include "buf.h"

/* One line of the chart: n points (x[i], y[i]); points whose y is not finite are left out. */
typedef struct gw_plot_series {
    const char *name;  /* in the legend (XML-escaped) */
    const char *color; /* a CSS colour such as "#1f77b4" (written as given) */
    const double *x, *y;
    size_t n;
} gw_plot_series;

/* Appends to out an SVG chart titled `title` of series[0..n_series): axes over the points' range
 * with round-number ticks and gridlines, axis titles x_label and y_label, one polyline per
 * series (a lone point as a dot) and a legend. A chart without points has its axes and the
 * words "no data". FU_OK or FU_ERR_NOMEM (out then holds a partial document). */
int gw_plot_svg(const char *title, const char *x_label, const char *y_label, const gw_plot_series *series,
                int n_series, fu_buf *out);

#endif
