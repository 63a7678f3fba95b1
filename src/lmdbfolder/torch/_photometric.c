/* The photometric operations of lmdbfolder.torch.photometric on the CPU, in C.
 *
 * Why a C module: the same operations as torch tensor operations take ~30
 * passes over the image each (the hue's float64 steps, the blur's int64 ones)
 * and cost more than Pillow's own C code; one pass per pixel here costs a
 * fraction of it. The tensor operations stay the reference and the path for
 * other devices; lmdbfolder.torch.photometric checks once per process that this
 * module gives their values, bit for bit, before it uses it.
 *
 * Every function works in place on a C-contiguous uint8 buffer of n images of
 * 3 planes of h x w (N x 3 x H x W), with one parameter per image, and releases
 * the GIL while it runs. The arithmetic is Pillow's, as described in
 * photometric.py: blends in float32 (truncated, clipped), the luma in 16-bit
 * fixed point, the HSV round trip with Pillow's float/double steps, the
 * extended box blur with 8.24 fixed-point weights and repeated edges.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Hot loops are compiled twice, for AVX2 and for any x86-64 (the loader picks one at
 * run time): the same operations in the same order, so the same values, twice as many
 * per instruction where AVX2 is there. Elsewhere, one plain version. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

static inline int luma(int r, int g, int b) { return (r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16; }

static inline uint8_t blend1(int base, int x, float alpha) {
    float temp = (float)base + alpha * (float)(x - base);
    if (temp <= 0.0f) return 0;
    if (temp >= 255.0f) return 255;
    return (uint8_t)temp;
}

static int check_images(Py_buffer *img, Py_ssize_t n, Py_ssize_t h, Py_ssize_t w) {
    if (n < 0 || h <= 0 || w <= 0 || img->len != n * 3 * h * w) {
        PyErr_SetString(PyExc_ValueError, "the buffer is not n x 3 x h x w bytes");
        return -1;
    }
    return 0;
}

static int check_params(Py_buffer *p, Py_ssize_t n, Py_ssize_t size) {
    if (p->len != n * size) {
        PyErr_SetString(PyExc_ValueError, "one parameter per image is needed");
        return -1;
    }
    return 0;
}

/* One image's blend (see blend_doc), in place. */
VECTOR_CLONES static void blend_image(uint8_t *r, Py_ssize_t plane, int kind, float a) {
    uint8_t *g = r + plane, *b = g + plane;
    if (kind == 3) {
        for (Py_ssize_t i = 0; i < plane; i++) r[i] = g[i] = b[i] = (uint8_t)luma(r[i], g[i], b[i]);
    } else if (kind == 4) {
        for (Py_ssize_t i = 0; i < 3 * plane; i++) r[i] = r[i] >= 128 ? (uint8_t)(255 - r[i]) : r[i];
    } else if (kind == 0) {
        for (Py_ssize_t i = 0; i < 3 * plane; i++) r[i] = blend1(0, r[i], a);
    } else if (kind == 1) {
        uint64_t total = 0;
        for (Py_ssize_t i = 0; i < plane; i++) total += (uint64_t)luma(r[i], g[i], b[i]);
        int mean = (int)floor((double)total / (double)plane + 0.5);
        for (Py_ssize_t i = 0; i < 3 * plane; i++) r[i] = blend1(mean, r[i], a);
    } else {
        for (Py_ssize_t i = 0; i < plane; i++) {
            int l = luma(r[i], g[i], b[i]);
            r[i] = blend1(l, r[i], a);
            g[i] = blend1(l, g[i], a);
            b[i] = blend1(l, b[i], a);
        }
    }
}

PyDoc_STRVAR(blend_doc,
             "blend(images, n, h, w, kind, alphas)\n\n"
             "In place: kind 0 brightness (a blend with black), 1 contrast (with the grey of the\n"
             "mean luma), 2 saturation (with the luma image), 3 grayscale (the luma in the three\n"
             "planes), 4 solarize (values >= 128 inverted); alphas: n float32 (kinds 3 and 4 ignore\n"
             "them), a NaN for an image to leave as it is.");

static PyObject *blend(PyObject *self, PyObject *args) {
    Py_buffer img, par;
    Py_ssize_t n, h, w;
    int kind;
    if (!PyArg_ParseTuple(args, "w*nnniy*", &img, &n, &h, &w, &kind, &par)) return NULL;
    if (check_images(&img, n, h, w) < 0 || check_params(&par, n, sizeof(float)) < 0 || kind < 0 || kind > 4) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "kind must be 0 to 4");
        PyBuffer_Release(&img);
        PyBuffer_Release(&par);
        return NULL;
    }
    uint8_t *data = (uint8_t *)img.buf;
    const float *alphas = (const float *)par.buf;
    Py_ssize_t plane = h * w;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t k = 0; k < n; k++)
        if (alphas[k] == alphas[k]) /* NaN: not this image */
            blend_image(data + k * 3 * plane, plane, kind, alphas[k]);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&img);
    PyBuffer_Release(&par);
    Py_RETURN_NONE;
}

/* C's round() of a value in 0..255 (half away from zero), without the library call. */
static inline uint8_t round8(double v) {
    if (v <= 0) return 0;
    int whole = (int)v;
    whole += (v - (double)whole) >= 0.5;
    return whole >= 255 ? 255 : (uint8_t)whole;
}

/* quotient[a][b] = (float)a / (float)b: the hue's float divisions, by table (the same values);
 * and per hue byte and saturation byte the values hsv2rgb derives from them alone. */
static float quotient[256][256];
static int hue_sector[256];
static float hue_frac[256];
static float sat_frac[256];

/* The hue shift of one image's planes, in chunks of HUE_CHUNK pixels: RGB -> HSV into
 * small arrays, then HSV -> RGB. Both loops are written without branches or table
 * lookups (selects only), so that the compiler vectorises them; the arithmetic is
 * Pillow's (rgb2hsv_row, hsv2rgb), step by step, as the scalar description in
 * photometric.py. Pixels whose values a step leaves undefined (a grey pixel's hue)
 * are computed with a harmless stand-in and masked. */
#define HUE_CHUNK 256

VECTOR_CLONES static void hue_plane(uint8_t *R, Py_ssize_t plane, int shift) {
    uint8_t *G = R + plane, *B = G + plane;
    int32_t uh[HUE_CHUNK], us[HUE_CHUNK], uv[HUE_CHUNK];
    for (Py_ssize_t at = 0; at < plane; at += HUE_CHUNK) {
        int m = (int)(plane - at < HUE_CHUNK ? plane - at : HUE_CHUNK);
        uint8_t *r8 = R + at, *g8 = G + at, *b8 = B + at;
        for (int i = 0; i < m; i++) {
            int32_t r = r8[i], g = g8[i], b = b8[i];
            int32_t mx = r > g ? r : g;
            mx = mx > b ? mx : b;
            int32_t mn = r < g ? r : g;
            mn = mn < b ? mn : b;
            int32_t grey = mx == mn;
            float cr = (float)(grey ? 1 : mx - mn);
            float s = (float)(mx - mn) / (float)(mx > 0 ? mx : 1);
            float rc = (float)(mx - r) / cr, gc = (float)(mx - g) / cr, bc = (float)(mx - b) / cr;
            float h1 = bc - gc;
            float h2 = (float)(2.0 + (double)rc - (double)bc);
            float h3 = (float)(4.0 + (double)gc - (double)rc);
            float hh = r == mx ? h1 : (g == mx ? h2 : h3);
            double turn = (double)hh / 6.0 + 1.0; /* in [0, 2): fmod(turn, 1.0), exactly */
            turn = turn >= 1.0 ? turn - 1.0 : turn;
            int32_t ih = (int32_t)((double)(float)turn * 255.0);
            int32_t is = (int32_t)((double)s * 255.0);
            ih = ih < 0 ? 0 : (ih > 255 ? 255 : ih);
            is = is < 0 ? 0 : (is > 255 ? 255 : is);
            uh[i] = grey ? 0 : ih;
            us[i] = grey ? 0 : is;
            uv[i] = mx;
        }
        for (int i = 0; i < m; i++) {
            int32_t hv = (uh[i] + shift) & 255, sat = us[i], v = uv[i];
            /* Pillow converts the bytes to float first: exact, so straight to double here. */
            double hf = (double)hv * 6.0 / 255.0;
            int32_t sector = (int32_t)hf; /* floor: hf >= 0 */
            float f = (float)(hf - (double)sector);
            float fs = (float)((double)sat / 255.0);
            double vd = (double)v;
            double pd = vd * (1.0 - (double)fs);
            double qd = vd * (1.0 - (double)(fs * f));
            double td = vd * (1.0 - (double)fs * (1.0 - (double)f));
            /* C's round of a value in 0..255: half away from zero */
            int32_t p = (int32_t)pd, q = (int32_t)qd, t = (int32_t)td;
            p += (int32_t)((pd - (double)p) >= 0.5);
            q += (int32_t)((qd - (double)q) >= 0.5);
            t += (int32_t)((td - (double)t) >= 0.5);
            p = p > 255 ? 255 : p;
            q = q > 255 ? 255 : q;
            t = t > 255 ? 255 : t;
            /* The sector's (r, g, b) as (v, t, p, q) picks, by masks (sector 6 is 0). */
            int32_t c = sector - 6 * (sector == 6);
            int32_t e0 = -(c == 0), e1 = -(c == 1), e2 = -(c == 2), e3 = -(c == 3), e4 = -(c == 4), e5 = -(c == 5);
            int32_t red = (v & (e0 | e5)) | (q & e1) | (p & (e2 | e3)) | (t & e4);
            int32_t green = (t & e0) | (v & (e1 | e2)) | (q & e3) | (p & (e4 | e5));
            int32_t blue = (p & (e0 | e1)) | (t & e2) | (v & (e3 | e4)) | (q & e5);
            int32_t grey = -(sat == 0);
            uh[i] = (v & grey) | (red & ~grey);
            us[i] = (v & grey) | (green & ~grey);
            uv[i] = (v & grey) | (blue & ~grey);
        }
        for (int i = 0; i < m; i++) {
            r8[i] = (uint8_t)uh[i];
            g8[i] = (uint8_t)us[i];
            b8[i] = (uint8_t)uv[i];
        }
    }
}

PyDoc_STRVAR(hue_doc,
             "hue(images, n, h, w, shifts)\n\n"
             "In place: torchvision's adjust_hue of a PIL image; shifts: n int32, the hue byte's\n"
             "shift (int(factor * 255) modulo 256), -1 for an image to leave as it is.");

static PyObject *hue(PyObject *self, PyObject *args) {
    Py_buffer img, par;
    Py_ssize_t n, h, w;
    if (!PyArg_ParseTuple(args, "w*nnny*", &img, &n, &h, &w, &par)) return NULL;
    if (check_images(&img, n, h, w) < 0 || check_params(&par, n, sizeof(int32_t)) < 0) {
        PyBuffer_Release(&img);
        PyBuffer_Release(&par);
        return NULL;
    }
    uint8_t *data = (uint8_t *)img.buf;
    const int32_t *shifts = (const int32_t *)par.buf;
    Py_ssize_t plane = h * w;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (shifts[k] < 0) continue;
        hue_plane(data + k * 3 * plane, plane, shifts[k] & 255);
    }
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&img);
    PyBuffer_Release(&par);
    Py_RETURN_NONE;
}

/* The extended box blur of one plane (h x w, in place), Pillow's three passes along the
 * rows, then three along the columns. Edges repeat; each pass rounds to 8 bits. Each
 * pass sums whole rows (a padded copy of the row for the row passes, row pointers for
 * the column passes) into a uint32 accumulator row, so every inner loop runs along
 * contiguous memory with no bounds checks and the compiler vectorises it. */
static inline void finish_row(uint8_t *out, const uint32_t *acc, const uint8_t *lo, const uint8_t *hi, Py_ssize_t w,
                              uint32_t ww, uint32_t fw) {
    for (Py_ssize_t x = 0; x < w; x++)
        out[x] = (uint8_t)((acc[x] * ww + ((uint32_t)lo[x] + (uint32_t)hi[x]) * fw + (1u << 23)) >> 24);
}

VECTOR_CLONES static void plane_blur(uint8_t *p, Py_ssize_t h, Py_ssize_t w, int radius, uint32_t ww, uint32_t fw, uint8_t *line,
                       uint8_t *copy, uint32_t *acc) {
    int pad = radius + 1, span = 2 * radius + 1;
    for (int pass = 0; pass < 3; pass++)
        for (Py_ssize_t y = 0; y < h; y++) {
            uint8_t *row = p + y * w;
            memset(line, row[0], (size_t)pad);
            memcpy(line + pad, row, (size_t)w);
            memset(line + pad + w, row[w - 1], (size_t)pad);
            for (Py_ssize_t x = 0; x < w; x++) acc[x] = line[x + 1];
            for (int j = 2; j <= span; j++) {
                const uint8_t *src = line + j;
                for (Py_ssize_t x = 0; x < w; x++) acc[x] += src[x];
            }
            finish_row(row, acc, line, line + span + 1, w, ww, fw);
        }
    const uint8_t *rows[64];
    for (int pass = 0; pass < 3; pass++) {
        memcpy(copy, p, (size_t)(h * w));
        for (Py_ssize_t y = 0; y < h; y++) {
            for (int j = 0; j <= span + 1; j++) {
                Py_ssize_t at = y - pad + j;
                at = at < 0 ? 0 : (at >= h ? h - 1 : at);
                rows[j] = copy + at * w;
            }
            for (Py_ssize_t x = 0; x < w; x++) acc[x] = rows[1][x];
            for (int j = 2; j <= span; j++) {
                const uint8_t *src = rows[j];
                for (Py_ssize_t x = 0; x < w; x++) acc[x] += src[x];
            }
            finish_row(p + y * w, acc, rows[0], rows[span + 1], w, ww, fw);
        }
    }
}

PyDoc_STRVAR(blur_doc,
             "blur(images, n, h, w, radii, inner, edge)\n\n"
             "In place: Pillow's GaussianBlur as three extended box-blur passes along the rows,\n"
             "then three along the columns; per image its whole box radius (int32 0..30, -1: no\n"
             "blur) and 8.24 weights (uint32 inner, uint32 edge).");

static PyObject *blur(PyObject *self, PyObject *args) {
    Py_buffer img, prad, pin, pedge;
    Py_ssize_t n, h, w;
    if (!PyArg_ParseTuple(args, "w*nnny*y*y*", &img, &n, &h, &w, &prad, &pin, &pedge)) return NULL;
    PyObject *result = NULL;
    uint8_t *line = NULL, *copy = NULL;
    uint32_t *acc = NULL;
    if (check_images(&img, n, h, w) < 0 || check_params(&prad, n, 4) < 0 || check_params(&pin, n, 4) < 0 ||
        check_params(&pedge, n, 4) < 0)
        goto done;
    const int32_t *radii = (const int32_t *)prad.buf;
    for (Py_ssize_t k = 0; k < n; k++)
        if (radii[k] > 30) {
            PyErr_SetString(PyExc_ValueError, "a box radius above 30");
            goto done;
        }
    line = malloc((size_t)(w + 64));
    copy = malloc((size_t)(h * w));
    acc = malloc(sizeof(uint32_t) * (size_t)w);
    if (line == NULL || copy == NULL || acc == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    {
        uint8_t *data = (uint8_t *)img.buf;
        const uint32_t *inner = (const uint32_t *)pin.buf, *edge = (const uint32_t *)pedge.buf;
        Py_ssize_t plane = h * w;
        Py_BEGIN_ALLOW_THREADS;
        for (Py_ssize_t k = 0; k < n; k++) {
            if (radii[k] < 0) continue;
            for (int c = 0; c < 3; c++) plane_blur(data + (k * 3 + c) * plane, h, w, radii[k], inner[k], edge[k], line, copy, acc);
        }
        Py_END_ALLOW_THREADS;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    free(line);
    free(copy);
    free(acc);
    PyBuffer_Release(&img);
    PyBuffer_Release(&prad);
    PyBuffer_Release(&pin);
    PyBuffer_Release(&pedge);
    return result;
}

VECTOR_CLONES static void lookup_plane(const uint8_t *s, float *d, Py_ssize_t plane, const float *t) {
    for (Py_ssize_t i = 0; i < plane; i++) d[i] = t[s[i]];
}

PyDoc_STRVAR(lookup_doc,
             "lookup(images, n, h, w, table, out)\n\n"
             "out[k, c] = table[c][images[k, c]] for the n x 3 x h x w uint8 images: table is\n"
             "3 x 256 float32 (ToTensor + Normalize of every byte value), out n x 3 x h x w float32.");

static PyObject *lookup(PyObject *self, PyObject *args) {
    Py_buffer img, tab, out;
    Py_ssize_t n, h, w;
    if (!PyArg_ParseTuple(args, "y*nnny*w*", &img, &n, &h, &w, &tab, &out)) return NULL;
    PyObject *result = NULL;
    if (check_images(&img, n, h, w) < 0) goto done;
    if (tab.len != 3 * 256 * (Py_ssize_t)sizeof(float) || out.len != img.len * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "table must be 3 x 256 float32 and out n x 3 x h x w float32");
        goto done;
    }
    {
        const uint8_t *src = (const uint8_t *)img.buf;
        const float *table = (const float *)tab.buf;
        float *dst = (float *)out.buf;
        Py_ssize_t plane = h * w;
        Py_BEGIN_ALLOW_THREADS;
        for (Py_ssize_t p = 0; p < 3 * n; p++) lookup_plane(src + p * plane, dst + p * plane, plane, table + (p % 3) * 256);
        Py_END_ALLOW_THREADS;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&img);
    PyBuffer_Release(&tab);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"lookup", lookup, METH_VARARGS, lookup_doc},
    {"blend", blend, METH_VARARGS, blend_doc},
    {"hue", hue, METH_VARARGS, hue_doc},
    {"blur", blur, METH_VARARGS, blur_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_photometric",
    "Photometric operations on uint8 image batches, in place, with Pillow's arithmetic (see photometric.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__photometric(void) {
    for (int a = 0; a < 256; a++)
        for (int b = 1; b < 256; b++) quotient[a][b] = (float)a / (float)b;
    for (int v = 0; v < 256; v++) {
        double hf = (double)(float)v * 6.0 / 255.0;
        hue_sector[v] = (int)floor(hf);
        hue_frac[v] = (float)(hf - (double)(float)hue_sector[v]);
        sat_frac[v] = (float)((double)(float)v / 255.0);
    }
    return PyModule_Create(&module);
}
