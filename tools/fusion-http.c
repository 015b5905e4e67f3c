/* fusion-http.c -- a small libcurl client of a fusion gateway for `fusion chat` and `fusion status`.
 *
 * JSON requests (GET, or POST with a JSON body) and streamed POSTs whose bytes go to a sink as they
 * arrive (SSE). Errors come back as one line: curl's reason, or the HTTP status with the error
 * message of OpenAI's error object.
 * Threading: one thread per fz_http. Ownership: an fz_http owns its curl handle, base URL and key.
 */
#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fusion-cli.h"
#include "status.h"

int fz_http_init(fz_http *h, const char *url, const char *key) {
    memset(h, 0, sizeof *h);
    if (!url || !url[0]) url = getenv("FUSION_URL");
    if (!url || !url[0]) url = FZ_DEFAULT_URL;
    if (!key || !key[0]) key = getenv("FUSION_API_KEY");
    if (!key || !key[0]) key = getenv("OPENAI_API_KEY");
    size_t n = strlen(url);
    while (n > 0 && url[n - 1] == '/') n--;
    if (n >= 3 && !strncmp(url + n - 3, "/v1", 3)) n -= 3;
    h->base = strndup(url, n);
    h->key = key && key[0] ? strdup(key) : NULL;
    h->curl = curl_easy_init();
    if (!h->base || !h->curl || (key && key[0] && !h->key)) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    return FU_OK;
}

void fz_http_free(fz_http *h) {
    curl_easy_cleanup(h->curl);
    free(h->base);
    free(h->key);
    memset(h, 0, sizeof *h);
}

const char *fz_str(const json_t *o, const char *key, const char *def) {
    const char *s = json_string_value(json_object_get(o, key));
    return s ? s : def;
}

/* The request's common options; the headers to free after it (NULL when out of memory). */
static struct curl_slist *fz_http_setup(fz_http *h, const char *path, const char *body) {
    CURL *c = h->curl;
    fu_buf url = {0}, auth = {0};
    curl_easy_reset(c);
    h->error[0] = '\0';
    if (fu_buf_appendf(&url, "%s%s", h->base, path)) return NULL;
    curl_easy_setopt(c, CURLOPT_URL, url.data);
    fu_buf_free(&url);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, h->error);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, 10L);
    struct curl_slist *hd = curl_slist_append(NULL, "Expect:");
    if (h->key && !fu_buf_appendf(&auth, "Authorization: Bearer %s", h->key)) hd = curl_slist_append(hd, auth.data);
    fu_buf_free(&auth);
    if (body) {
        hd = curl_slist_append(hd, "Content-Type: application/json");
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    }
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hd);
    return hd;
}

/* The error of an HTTP reply: "STATUS: message" from OpenAI's error object, else the body's start. */
static int fz_http_error(long status, const char *body, size_t len) {
    json_t *doc = body ? json_loadb(body, len, 0, NULL) : NULL;
    json_t *e = json_object_get(doc, "error");
    const char *msg = json_is_string(e) ? json_string_value(e) : fz_str(e, "message", NULL);
    if (!msg) msg = fz_str(doc, "reason", NULL); /* /health's 503 */
    int rc = status == 401 || status == 403 ? FU_ERR_AUTH : status >= 500 ? FU_ERR_NETWORK : FU_ERR_INVALID;
    const char *hint = status == 401 ? " (give --api-key or set FUSION_API_KEY)" : "";
    if (msg) fu_errorf(rc, "%ld: %s%s", status, msg, hint);
    else fu_errorf(rc, "%ld: %.120s%s", status, body && len ? body : "(no body)", hint);
    json_decref(doc);
    return rc;
}

/* curl's write callback into an fu_buf. */
static size_t fz_http_collect(char *data, size_t size, size_t n, void *user) {
    return fu_buf_append(user, data, size * n) ? 0 : size * n;
}

/* curl's failure as one line. */
static int fz_http_curl_error(fz_http *h, CURLcode cc) {
    return fu_errorf(FU_ERR_NETWORK, "cannot reach %s: %s", h->base, h->error[0] ? h->error : curl_easy_strerror(cc));
}

int fz_http_json(fz_http *h, const char *path, const char *body, long *status, json_t **out) {
    fu_buf reply = {0};
    *out = NULL;
    *status = 0;
    struct curl_slist *hd = fz_http_setup(h, path, body);
    if (!hd) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    curl_easy_setopt(h->curl, CURLOPT_WRITEFUNCTION, fz_http_collect);
    curl_easy_setopt(h->curl, CURLOPT_WRITEDATA, &reply);
    curl_easy_setopt(h->curl, CURLOPT_TIMEOUT, 30L);
    CURLcode cc = curl_easy_perform(h->curl);
    curl_slist_free_all(hd);
    curl_easy_getinfo(h->curl, CURLINFO_RESPONSE_CODE, status);
    int rc = cc != CURLE_OK ? fz_http_curl_error(h, cc) : FU_OK;
    if (!rc) *out = reply.data ? json_loadb(reply.data, reply.len, 0, NULL) : NULL;
    if (!rc && *status / 100 != 2) rc = fz_http_error(*status, reply.data, reply.len);
    else if (!rc && !*out) rc = fu_errorf(FU_ERR_NETWORK, "GET %s: the reply is not JSON", path);
    fu_buf_free(&reply);
    return rc;
}

/* A streamed request's state: the sink, and the body of an error reply kept whole. */
typedef struct fz_stream {
    fz_http *h;
    fz_http_sink sink;
    void *user;
    fu_buf error_body;
    int aborted;
} fz_stream;

static size_t fz_http_stream_write(char *data, size_t size, size_t n, void *user) {
    fz_stream *s = user;
    long status = 0;
    curl_easy_getinfo(s->h->curl, CURLINFO_RESPONSE_CODE, &status);
    if (status / 100 != 2) return fu_buf_append(&s->error_body, data, size * n) ? 0 : size * n;
    if (fz_interrupted || s->sink(data, size * n, s->user)) {
        s->aborted = 1;
        return 0;
    }
    return size * n;
}

/* curl's progress callback: aborts a stream on Ctrl-C even while no byte arrives. */
static int fz_http_progress(void *user, curl_off_t a, curl_off_t b, curl_off_t c, curl_off_t d) {
    fz_stream *s = user;
    if (fz_interrupted) s->aborted = 1;
    return fz_interrupted ? 1 : 0;
}

int fz_http_stream(fz_http *h, const char *path, const char *body, fz_http_sink sink, void *user) {
    fz_stream s = {.h = h, .sink = sink, .user = user};
    struct curl_slist *hd = fz_http_setup(h, path, body);
    if (!hd) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    curl_easy_setopt(h->curl, CURLOPT_WRITEFUNCTION, fz_http_stream_write);
    curl_easy_setopt(h->curl, CURLOPT_WRITEDATA, &s);
    curl_easy_setopt(h->curl, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(h->curl, CURLOPT_XFERINFOFUNCTION, fz_http_progress);
    curl_easy_setopt(h->curl, CURLOPT_XFERINFODATA, &s);
    curl_easy_setopt(h->curl, CURLOPT_LOW_SPEED_LIMIT, 1L); /* no byte for 300 s: give up */
    curl_easy_setopt(h->curl, CURLOPT_LOW_SPEED_TIME, 300L);
    CURLcode cc = curl_easy_perform(h->curl);
    curl_slist_free_all(hd);
    long status = 0;
    curl_easy_getinfo(h->curl, CURLINFO_RESPONSE_CODE, &status);
    int rc = FU_OK;
    if (s.aborted) rc = fu_errorf(FU_ERR_CANCELLED, "interrupted");
    else if (cc != CURLE_OK) rc = fz_http_curl_error(h, cc);
    else if (status / 100 != 2) rc = fz_http_error(status, s.error_body.data, s.error_body.len);
    fu_buf_free(&s.error_body);
    return rc;
}
