/*
 * A small JSON reader for the stand-in NVML (nvml_stub.c includes it; the stub is one translation unit).
 * Enough of JSON for test descriptions: objects, arrays, strings (\u escapes become '?'), numbers (exact
 * for non-negative integers: byte counts exceed a double's precision), true, false, null.
 */

#ifndef NVML_STUB_JSON_H
#define NVML_STUB_JSON_H

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;

typedef struct jval {
    jtype t;
    double num;
    unsigned long long u; /* exact value for non-negative integers (byte counts exceed float precision) */
    int is_uint;
    char *str;
    int n;
    struct jval *items;
    char **keys;
} jval;

typedef struct {
    const char *s;
    size_t i, len;
    int err;
} jparser;

static void jskip(jparser *p) {
    while (p->i < p->len && isspace((unsigned char)p->s[p->i])) p->i++;
}

static int jparse(jparser *p, jval *out);

static char *jparse_str(jparser *p) {
    if (p->s[p->i] != '"') { p->err = 1; return NULL; }
    p->i++;
    char *buf = malloc(p->len - p->i + 1);
    size_t o = 0;
    while (p->i < p->len && p->s[p->i] != '"') {
        char c = p->s[p->i++];
        if (c == '\\' && p->i < p->len) {
            char e = p->s[p->i++];
            switch (e) {
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': /* non-ASCII is not needed by any test; keep the byte count sane */
                c = '?';
                p->i += (p->i + 4 <= p->len) ? 4 : 0;
                break;
            default: c = e; break; /* \" \\ \/ */
            }
        }
        buf[o++] = c;
    }
    if (p->i >= p->len) { p->err = 1; free(buf); return NULL; }
    p->i++; /* closing quote */
    buf[o] = '\0';
    return buf;
}

static int jparse(jparser *p, jval *out) {
    memset(out, 0, sizeof(*out));
    jskip(p);
    if (p->i >= p->len) { p->err = 1; return -1; }
    char c = p->s[p->i];
    if (c == '{' || c == '[') {
        int obj = c == '{';
        out->t = obj ? J_OBJ : J_ARR;
        p->i++;
        int cap = 4;
        out->items = calloc(cap, sizeof(jval));
        if (obj) out->keys = calloc(cap, sizeof(char *));
        jskip(p);
        if (p->i < p->len && p->s[p->i] == (obj ? '}' : ']')) { p->i++; return 0; }
        for (;;) {
            if (out->n == cap) {
                cap *= 2;
                out->items = realloc(out->items, cap * sizeof(jval));
                if (obj) out->keys = realloc(out->keys, cap * sizeof(char *));
            }
            if (obj) {
                jskip(p);
                char *k = jparse_str(p);
                if (!k) return -1;
                out->keys[out->n] = k;
                jskip(p);
                if (p->i >= p->len || p->s[p->i] != ':') { p->err = 1; out->n++; return -1; }
                p->i++;
            }
            int rc = jparse(p, &out->items[out->n]);
            out->n++;
            if (rc) return -1;
            jskip(p);
            if (p->i < p->len && p->s[p->i] == ',') { p->i++; continue; }
            if (p->i < p->len && p->s[p->i] == (obj ? '}' : ']')) { p->i++; return 0; }
            p->err = 1;
            return -1;
        }
    }
    if (c == '"') {
        out->t = J_STR;
        out->str = jparse_str(p);
        return out->str ? 0 : -1;
    }
    if (!strncmp(p->s + p->i, "true", 4)) { out->t = J_BOOL; out->num = 1; p->i += 4; return 0; }
    if (!strncmp(p->s + p->i, "false", 5)) { out->t = J_BOOL; p->i += 5; return 0; }
    if (!strncmp(p->s + p->i, "null", 4)) { out->t = J_NULL; p->i += 4; return 0; }
    char *end = NULL;
    out->t = J_NUM;
    out->num = strtod(p->s + p->i, &end);
    if (end == p->s + p->i) { p->err = 1; return -1; }
    size_t span = (size_t)(end - (p->s + p->i));
    if (c != '-' && !memchr(p->s + p->i, '.', span) && !memchr(p->s + p->i, 'e', span) &&
        !memchr(p->s + p->i, 'E', span)) {
        out->u = strtoull(p->s + p->i, NULL, 10);
        out->is_uint = 1;
    }
    p->i += span;
    return 0;
}

static void jfree(jval *v) {
    if (!v) return;
    free(v->str);
    for (int k = 0; k < v->n; k++) {
        jfree(&v->items[k]);
        if (v->keys) free(v->keys[k]);
    }
    free(v->items);
    free(v->keys);
}

static jval *jget(jval *obj, const char *key) {
    if (!obj || obj->t != J_OBJ) return NULL;
    for (int k = 0; k < obj->n; k++)
        if (!strcmp(obj->keys[k], key)) return &obj->items[k];
    return NULL;
}

static jval *jat(jval *arr, int idx) {
    if (!arr || arr->t != J_ARR || idx < 0 || idx >= arr->n) return NULL;
    return &arr->items[idx];
}

static unsigned long long jnum(jval *v, unsigned long long dflt) {
    if (!v || v->t != J_NUM) return dflt;
    return v->is_uint ? v->u : (unsigned long long)v->num;
}

/* A field given as a list is a sequence over calls: element `call`, the last one once past the end. */
static jval *jseq(jval *v, unsigned call) {
    if (!v || v->t != J_ARR || v->n == 0) return v;
    return &v->items[call < (unsigned)v->n ? (int)call : v->n - 1];
}

static const char *jstr(jval *v, const char *dflt) {
    return (v && v->t == J_STR) ? v->str : dflt;
}

#endif /* NVML_STUB_JSON_H */
