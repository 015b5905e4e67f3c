/* test_gw_plot.c -- SVG loss charts: one polyline per series with its finite points only, a lone
 * point drawn as a dot, names escaped, points inside the frame, and "no data" without points. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gw-plot.h"
#include "status.h"

/* Occurrences of needle in the buffer's text. */
static int count(const fu_buf *b, const char *needle) {
    int n = 0;
    for (const char *p = b->data; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

/* Every "x,y " pair of the first polyline lies within the canvas' frame. */
static void assert_points_inside(const fu_buf *b, int want) {
    const char *p = strstr(b->data, "points=\"");
    assert_non_null(p);
    p += 8;
    int n = 0;
    double x, y;
    for (int used; sscanf(p, "%lf,%lf %n", &x, &y, &used) == 2; p += used, n++)
        assert_true(x >= 70 && x <= 720 - 24 && y >= 44 && y <= 420 - 56);
    assert_int_equal(n, want);
}

static void test_two_series(void **state) {
    (void)state;
    const double step[] = {1, 2, 3, 4}, train[] = {2.5, 2.0, 1.2, 0.7}, valid[] = {NAN, 2.2, NAN, 1.0};
    gw_plot_series s[2] = {{"training <loss>", "#1f77b4", step, train, 4}, {"validation & co", "#d62728", step, valid, 4}};
    fu_buf b = {0};
    assert_int_equal(gw_plot_svg("Loss of \"job\"", "step", "loss", s, 2, &b), FU_OK);
    assert_int_equal(fu_buf_append(&b, "", 1), FU_OK); /* a terminated string */
    assert_non_null(strstr(b.data, "<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert_non_null(strstr(b.data, "training &lt;loss&gt;"));
    assert_non_null(strstr(b.data, "validation &amp; co"));
    assert_non_null(strstr(b.data, "Loss of &quot;job&quot;"));
    assert_int_equal(count(&b, "<polyline"), 2);
    assert_int_equal(count(&b, "<circle"), 0);
    assert_points_inside(&b, 4);
    assert_non_null(strstr(b.data, "</svg>\n"));
    fu_buf_free(&b);
}

static void test_lone_point_and_no_data(void **state) {
    (void)state;
    const double x[] = {5}, y[] = {1.5}, none[] = {NAN};
    gw_plot_series one = {"loss", "red", x, y, 1}, empty = {"loss", "red", x, none, 1};
    fu_buf b = {0};
    assert_int_equal(gw_plot_svg("t", "step", "loss", &one, 1, &b), FU_OK);
    assert_int_equal(fu_buf_append(&b, "", 1), FU_OK);
    assert_int_equal(count(&b, "<circle"), 1);
    assert_points_inside(&b, 1);
    fu_buf_free(&b);
    b = (fu_buf){0};
    assert_int_equal(gw_plot_svg("t", "step", "loss", &empty, 1, &b), FU_OK);
    assert_int_equal(fu_buf_append(&b, "", 1), FU_OK);
    assert_non_null(strstr(b.data, "no data"));
    assert_int_equal(count(&b, "<polyline"), 0);
    fu_buf_free(&b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_series),
        cmocka_unit_test(test_lone_point_and_no_data),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
