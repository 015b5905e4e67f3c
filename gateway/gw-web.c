/* gw-web.c -- serves the swarm page's embedded files (gw-web.h). */
#include "gw-web.h"

#include <microhttpd.h>
#include <string.h>

/* The page loads nothing but its own files and talks to nothing but this gateway. */
#define GW_WEB_CSP                                                                                        \
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "       \
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

const gw_web_file *gw_web_find(const char *url) {
    for (size_t i = 0; i < gw_web_n_files; i++)
        if (!strcmp(url, gw_web_files[i].url)) return &gw_web_files[i];
    return NULL;
}

bool gw_web_fresh(const gw_web_file *f, const char *inm, size_t len) {
    size_t n = strlen(f->etag);
    for (size_t i = 0; i < len; i++) {
        if (inm[i] == ' ' || inm[i] == ',' || inm[i] == '\t') continue;
        if (inm[i] == '*') return true;
        size_t j = i;
        while (j < len && inm[j] != ',') j++; /* one entry: inm[i..j) */
        size_t end = j;
        while (end > i && (inm[end - 1] == ' ' || inm[end - 1] == '\t')) end--;
        if (end - i >= 2 && !strncmp(inm + i, "W/", 2)) i += 2; /* weak comparison (RFC 9110 13.1.2) */
        if (end - i == n && !memcmp(inm + i, f->etag, n)) return true;
        i = j;
    }
    return false;
}

struct MHD_Response *gw_web_response(const gw_web_file *f, bool not_modified) {
    struct MHD_Response *r = MHD_create_response_from_buffer(not_modified ? 0 : f->len, (void *)f->data,
                                                             MHD_RESPMEM_PERSISTENT);
    if (!r) return NULL;
    if (!not_modified) MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, f->type);
    MHD_add_response_header(r, MHD_HTTP_HEADER_ETAG, f->etag);
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(r, "Content-Security-Policy", GW_WEB_CSP);
    MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(r, "X-Frame-Options", "DENY");
    MHD_add_response_header(r, "Referrer-Policy", "no-referrer");
    return r;
}
