/* gw-web.h -- the swarm page: index.html, app.js and style.css from gateway/web/, embedded at build time.
 *
 * The files are plain HTML/JS/CSS compiled into the binary as byte arrays by
 * gateway/web/embed.cmake (gw-web-data.c in the build tree), so the gateway
 * serves them with no file on disk. They carry no data: the page's script asks
 * the API (/v1/swarm, /health, /metrics, /v1/models, /v1/chat/completions) with
 * the key the user gives it, so the files themselves are served without a key.
 * Every response forbids everything but the gateway's own origin
 * (Content-Security-Policy: no inline script, no other host), is never framed,
 * and is revalidated by its ETag (Cache-Control: no-cache).
 *
 * Threading: the table is constant; every function is thread-safe. Ownership:
 * the files are static; responses are new libmicrohttpd responses that point
 * into them (the caller queues and destroys them).
 */
#ifndef FU_GW_WEB_H
#define FU_GW_WEB_H

#include <stdbool.h>
#include <stddef.h>

struct MHD_Response;

/* One embedded file: the URL path it answers, its Content-Type, its strong ETag (quoted). */
typedef struct gw_web_file {
    const char *url;
    const char *type;
    const char *etag;
    const unsigned char *data;
    size_t len;
} gw_web_file;

/* The embedded files (gw-web-data.c, generated). */
extern const gw_web_file gw_web_files[];
extern const size_t gw_web_n_files;

/* The file served at URL path `url` ("/" is index.html), or NULL. */
const gw_web_file *gw_web_find(const char *url);

/* Whether an If-None-Match value inm[0..len) names f's ETag ("*" too): the answer is then 304. */
bool gw_web_fresh(const gw_web_file *f, const char *inm, size_t len);

/* A response for f with its headers: the bytes (not_modified false, or an empty body with
 * not_modified), Content-Type, ETag, Cache-Control, Content-Security-Policy and the
 * anti-framing / anti-sniffing headers. New response (NULL when out of memory); the caller
 * queues and destroys it. */
struct MHD_Response *gw_web_response(const gw_web_file *f, bool not_modified);

#endif
