/* Decode only the rows and columns of a JPEG that a crop needs (libjpeg's
 * partial decode: jpeg_skip_scanlines and jpeg_crop_scanline, libjpeg-turbo
 * >= 1.5), for lmdbfolder.read.regions.
 *
 * Why a C module: no installed Python binding exposes libjpeg-turbo's partial
 * decode, and it saves a third of a full-resolution decode under
 * RandomResizedCrop. The rows below the crop are not decoded at all; the rows
 * above are entropy-decoded only; the columns outside skip the IDCT, the
 * upsampling and the colour conversion.
 *
 * Exactness: the pixels returned are the full decode's, bit for bit, for every
 * column from left to left + width - 1. jpeg_crop_scanline starts the decode at
 * an iMCU boundary <= the requested column and treats the new edges as image
 * edges, so the chroma upsampling of the first and last decoded column lacks a
 * neighbour: the region asked of libjpeg is one column wider on the left and two
 * on the right than the caller's box, which puts those edge columns outside it.
 * The Python side checks the result against Pillow once per process.
 *
 * Any libjpeg warning (corrupt data that libjpeg decodes past) is an error here:
 * the caller then decodes the whole image the usual way, so a damaged JPEG ends
 * as it does in ImageFolder. The GIL is released while libjpeg runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <math.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <jpeglib.h>

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    int warned;
    char message[JMSG_LENGTH_MAX];
} error_mgr;

static void on_error(j_common_ptr cinfo) {
    error_mgr *err = (error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    error_mgr *err = (error_mgr *)cinfo->err;
    if (level < 0 && !err->warned) { /* level >= 0: trace messages, not damage */
        (*cinfo->err->format_message)(cinfo, err->message);
        err->warned = 1;
    }
}

enum outcome { DONE, LIBJPEG_ERROR, UNTESTED_SAMPLING, MARKER_BELOW, BOX_OUTSIDE, OUT_TOO_SMALL, OTHER_SIZE, SHORT_READ };

/* Whether the bytes libjpeg has not read hold only entropy-coded data, restart
 * markers and the final EOI. A whole decode reads them and fails on a stray
 * marker there (a second SOF, a bogus table): such a file must fail here too,
 * not decode by region because its damage lies below the crop. Damage without
 * markers is only ever a warning in libjpeg, and the crop's rows are the same. */
static int plain_entropy_data(const JOCTET *p, size_t n, int unread_marker) {
    if (unread_marker != 0 && unread_marker != 0xD9 && (unread_marker < 0xD0 || unread_marker > 0xD7))
        return 0;
    if (unread_marker == 0xD9)
        return n == 0;
    const JOCTET *end = p + n;
    while (p < end) {
        const JOCTET *ff = memchr(p, 0xFF, (size_t)(end - p));
        if (ff == NULL || ff + 1 >= end)
            return 0; /* the payload ends with FF D9, so the last FF is never the last byte */
        JOCTET next = ff[1];
        if (next == 0xD9)
            return ff + 2 == end;
        if (next != 0x00 && next != 0xFF && (next < 0xD0 || next > 0xD7))
            return 0;
        p = ff + 1;
    }
    return 0;
}

/* Greyscale, or Y at 1x1, 2x1 or 2x2 with 1x1 chroma (4:4:4, 4:2:2, 4:2:0): the
 * layouts whose regions the tests compare with Pillow. Others (4:4:0, 4:1:1, odd
 * factors) are left to the whole decode rather than trusted untested. */
static int tested_sampling(j_decompress_ptr cinfo) {
    jpeg_component_info *c = cinfo->comp_info;
    if (cinfo->num_components == 1)
        return 1;
    if (cinfo->num_components != 3 || c[1].h_samp_factor != 1 || c[1].v_samp_factor != 1 ||
        c[2].h_samp_factor != 1 || c[2].v_samp_factor != 1)
        return 0;
    return (c[0].h_samp_factor == 1 && c[0].v_samp_factor == 1) || (c[0].h_samp_factor == 2 && c[0].v_samp_factor <= 2);
}

/* The decode itself, after jpeg_read_header; libjpeg errors longjmp out of it. */
static enum outcome read_region(j_decompress_ptr cinfo, int left, int top, int width, int height, Py_buffer *out,
                                int expect_w, int expect_h, JDIMENSION *x0, JDIMENSION *w0) {
    if (!tested_sampling(cinfo))
        return UNTESTED_SAMPLING;
    /* The caller drew its box from the record header's size: the image must be that size. */
    if (expect_w > 0 && expect_h > 0 &&
        (cinfo->image_width != (JDIMENSION)expect_w || cinfo->image_height != (JDIMENSION)expect_h))
        return OTHER_SIZE;
    cinfo->out_color_space = JCS_RGB; /* greyscale comes out as R = G = B, as Pillow's convert("RGB") */
    jpeg_start_decompress(cinfo);
    JDIMENSION image_w = cinfo->output_width, image_h = cinfo->output_height;
    if (left < 0 || top < 0 || width <= 0 || height <= 0 || (JDIMENSION)left + (JDIMENSION)width > image_w ||
        (JDIMENSION)top + (JDIMENSION)height > image_h)
        return BOX_OUTSIDE;
    JDIMENSION right = (JDIMENSION)left + (JDIMENSION)width + 2;
    JDIMENSION x = left > 0 ? (JDIMENSION)left - 1 : 0;
    if (right > image_w)
        right = image_w;
    JDIMENSION w = right - x;
    jpeg_crop_scanline(cinfo, &x, &w); /* moves x down to an iMCU boundary, widens w */
    size_t stride = (size_t)w * 3;
    if ((size_t)out->len < stride * (size_t)height)
        return OUT_TOO_SMALL;
    if (top > 0)
        jpeg_skip_scanlines(cinfo, (JDIMENSION)top);
    /* Rows are written at (output_scanline - top): never trust that the skip landed there. */
    if (cinfo->output_scanline != (JDIMENSION)top)
        return SHORT_READ;
    JDIMENSION end = (JDIMENSION)top + (JDIMENSION)height;
    /* Several rows per call: libjpeg delivers up to a row group (max_v_samp_factor * DCT
     * size rows) at once, and a call per row costs its bookkeeping once per row. */
    JSAMPROW rows[32];
    while (cinfo->output_scanline < end) {
        JDIMENSION at = cinfo->output_scanline;
        if (at < (JDIMENSION)top)
            return SHORT_READ;
        JDIMENSION want = end - at < 32 ? end - at : 32;
        for (JDIMENSION r = 0; r < want; r++)
            rows[r] = (JSAMPROW)out->buf + (size_t)(at + r - (JDIMENSION)top) * stride;
        if (jpeg_read_scanlines(cinfo, rows, want) == 0)
            return SHORT_READ; /* no progress (a suspending source): never loop on it */
    }
    if (!jpeg_has_multiple_scans(cinfo) &&
        !plain_entropy_data(cinfo->src->next_input_byte, cinfo->src->bytes_in_buffer, cinfo->unread_marker))
        return MARKER_BELOW; /* a progressive JPEG was read whole by jpeg_start_decompress */
    *x0 = x;
    *w0 = w;
    return DONE;
}

/* The region decode of a JPEG in memory: libjpeg set up with this module's error
 * handling, the header read, read_region, the decompressor destroyed (which aborts:
 * the rows below the crop are never read). `err` says what libjpeg said. Needs no GIL. */
static enum outcome decode_into(const JOCTET *data, size_t len, int left, int top, int width, int height,
                                Py_buffer *out, int expect_w, int expect_h, JDIMENSION *x0, JDIMENSION *w0,
                                error_mgr *err) {
    struct jpeg_decompress_struct cinfo;
    memset(&cinfo, 0, sizeof(cinfo)); /* jpeg_destroy of a never-created object is then a no-op */
    memset(err, 0, sizeof(*err));
    cinfo.err = jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    volatile enum outcome result = DONE; /* volatile: set after a longjmp */
    if (setjmp(err->jump)) {
        result = LIBJPEG_ERROR;
    } else {
        jpeg_create_decompress(&cinfo);
        jpeg_mem_src(&cinfo, data, (unsigned long)len);
        jpeg_read_header(&cinfo, TRUE);
        result = read_region(&cinfo, left, top, width, height, out, expect_w, expect_h, x0, w0);
    }
    jpeg_destroy_decompress(&cinfo);
    return result;
}

PyDoc_STRVAR(decode_region_doc,
"decode_region(data, left, top, width, height, out, image_width=0, image_height=0) -> (x0, w0)\n\n"
"Decode rows top .. top+height-1 of the JPEG ``data`` as RGB into the writable\n"
"buffer ``out``, columns x0 .. x0+w0-1 of each (row stride 3*w0), with\n"
"x0 < left when left > 0 and x0 + w0 >= left + width. The caller's box starts\n"
"at column left - x0 of each row. Raises ValueError for a JPEG libjpeg cannot\n"
"decode or warns about, one with a stray marker after the crop's rows, an\n"
"untested chroma layout, a box outside the image, an image whose size is not\n"
"image_width x image_height (when they are given, > 0), or an ``out`` that is too\n"
"small (3 * image width * height bytes always suffice).");

static PyObject *decode_region(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    int left, top, width, height, expect_w = 0, expect_h = 0;
    if (!PyArg_ParseTuple(args, "y*iiiiw*|ii", &data, &left, &top, &width, &height, &out, &expect_w, &expect_h))
        return NULL;
    error_mgr err;
    enum outcome result;
    JDIMENSION x0 = 0, w0 = 0; /* read only when the decode is DONE */
    Py_BEGIN_ALLOW_THREADS
    result = decode_into((const JOCTET *)data.buf, (size_t)data.len, left, top, width, height, &out, expect_w, expect_h,
                         &x0, &w0, &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    switch (result) {
    case LIBJPEG_ERROR:
        PyErr_Format(PyExc_ValueError, "libjpeg: %s", err.message);
        return NULL;
    case MARKER_BELOW:
        PyErr_SetString(PyExc_ValueError, "a marker other than RSTn or EOI after the crop's rows: damaged");
        return NULL;
    case UNTESTED_SAMPLING:
        PyErr_SetString(PyExc_ValueError, "chroma sampling other than 4:4:4, 4:2:2, 4:2:0 or greyscale");
        return NULL;
    case BOX_OUTSIDE:
        PyErr_Format(PyExc_ValueError, "box (left %d, top %d, width %d, height %d) is not inside the image", left, top,
                     width, height);
        return NULL;
    case OUT_TOO_SMALL:
        PyErr_SetString(PyExc_ValueError, "the output buffer is too small for the region");
        return NULL;
    case OTHER_SIZE:
        PyErr_Format(PyExc_ValueError, "the image is not %dx%d", expect_w, expect_h);
        return NULL;
    case SHORT_READ:
        PyErr_SetString(PyExc_ValueError, "libjpeg did not deliver the region's rows");
        return NULL;
    default:
        break;
    }
    if (err.warned) {
        PyErr_Format(PyExc_ValueError, "libjpeg warned: %s", err.message);
        return NULL;
    }
    return Py_BuildValue("II", (unsigned int)x0, (unsigned int)w0);
}

/* ---- Pillow's bilinear resize, exactly -------------------------------------
 *
 * The default path must give ImageFolder's pixels, so the crop is resized as
 * Pillow's Image.resize(size, BILINEAR) resizes an RGB image: two passes
 * (horizontal over the rows the vertical pass needs, then vertical), each
 * output sample a sum of input samples times fixed-point weights (22 fraction
 * bits, from double weights normalised to sum 1), rounded and clipped. The
 * arithmetic below is written to give the same numbers: the same double
 * expressions in the same order (fp contraction is off in setup.py), the same
 * truncations. Done here, the resize reads the decoded region in place and
 * writes the output straight into its slot of the batch (CHW planes, flipped
 * if asked), instead of three copies through a PIL image. The Python side
 * compares it with Pillow once per process before using it. */

#define RESIZE_BITS 22
/* The AVX2 passes multiply 16-bit pairs (vpmaddwd). Pillow's weights have 22 fractional
 * bits, too many for 16, so each is split as k = hi * 2^11 + lo (lo in [0, 2^11), hi = k >> 11,
 * both fit an int16) and the two sums combined: sum(v * k) = (sum(v * hi) << 11) + sum(v * lo),
 * the same integer as Pillow's. */
#define HSPLIT 11

/* The two halves of a weight as HSPLIT splits it. */
static inline int16_t weight_lo(int32_t k) { return (int16_t)(k & ((1 << HSPLIT) - 1)); }
static inline int16_t weight_hi(int32_t k) { return (int16_t)(k >> HSPLIT); }

/* Two int16 as the 32-bit lane vpmaddwd pairs them in: `a` low, `b` high. */
static inline int32_t int16_pair(int16_t a, int16_t b) { return (int32_t)(((uint32_t)(uint16_t)b << 16) | (uint16_t)a); }

/* Pillow's bicubic filter (a = -0.5), support 2. */
static inline double bicubic_filter(double x) {
    const double a = -0.5;
    if (x < 0.0)
        x = -x;
    if (x < 1.0)
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
    if (x < 2.0)
        return (((x - 5) * x + 8) * x - 4) * a;
    return 0.0;
}

/* Weights of output samples 0 .. out - 1 over input samples 0 .. in - 1 (Pillow's
 * bilinear filter, or with `cubic` its bicubic one): first[o] and count[o] (the taps),
 * weights[o * ksize + t]. Returns ksize or 0. */
static int bilinear_weights(int in, int out, int cubic, int **first_p, int **count_p, int32_t **weights_p) {
    double scale = (double)(float)in / out; /* Pillow takes the box as floats */
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = (cubic ? 2.0 : 1.0) * filterscale;
    if (in <= 0 || out <= 0 || support > (double)(INT_MAX / 4))
        return 0; /* ksize would overflow an int */
    int ksize = (int)ceil(support) * 2 + 1;
    int *first = malloc(sizeof(int) * (size_t)out), *count = malloc(sizeof(int) * (size_t)out);
    double *w = malloc(sizeof(double) * (size_t)ksize);
    int32_t *weights = malloc(sizeof(int32_t) * (size_t)out * (size_t)ksize);
    if (!first || !count || !w || !weights) {
        free(first), free(count), free(w), free(weights);
        return 0;
    }
    for (int o = 0; o < out; o++) {
        double center = 0.0 + (o + 0.5) * scale;
        double total = 0.0, inv = 1.0 / filterscale;
        int lo = (int)(center - support + 0.5), hi = (int)(center + support + 0.5);
        if (lo < 0)
            lo = 0;
        if (hi > in)
            hi = in;
        int n = hi - lo;
        for (int t = 0; t < n; t++) {
            double x = ((t + lo) - center + 0.5) * inv;
            if (cubic) {
                w[t] = bicubic_filter(x);
            } else {
                if (x < 0.0)
                    x = -x;
                w[t] = x < 1.0 ? 1.0 - x : 0.0;
            }
            total += w[t];
        }
        for (int t = 0; t < ksize; t++) {
            double k = t < n ? (total != 0.0 ? w[t] / total : w[t]) : 0.0;
            weights[(size_t)o * (size_t)ksize + (size_t)t] = (int32_t)(k < 0 ? -0.5 + k * (1 << RESIZE_BITS) : 0.5 + k * (1 << RESIZE_BITS));
        }
        first[o] = lo;
        count[o] = n;
    }
    free(w);
    *first_p = first, *count_p = count, *weights_p = weights;
    return ksize;
}

static inline uint8_t clip8(int32_t v) {
    v >>= RESIZE_BITS;
    return v < 0 ? 0 : v > 255 ? 255 : (uint8_t)v;
}

/* One output pixel of the horizontal pass, the plain way: the `n` RGB pixels from `p`
 * times the weights `k`, rounded and clipped into rgb[0..2]. */
static inline void taps_rgb(const uint8_t *p, const int32_t *k, int n, uint8_t *rgb) {
    int32_t r = 1 << (RESIZE_BITS - 1), g = r, b = r;
    for (int i = 0; i < n; i++, p += 3) {
        r += p[0] * k[i];
        g += p[1] * k[i];
        b += p[2] * k[i];
    }
    rgb[0] = clip8(r), rgb[1] = clip8(g), rgb[2] = clip8(b);
}

/* Where output pixel (y, x) of a pass goes: interleaved rows of `stride` bytes,
 * or (the last pass of a batch image) three planes, mirrored if asked. */
typedef struct {
    uint8_t *buf;
    size_t stride;
    int width, planar, flip;
    size_t plane;
} target;

static inline void store(const target *t, int y, int x, uint8_t r, uint8_t g, uint8_t b) {
    int ox = t->flip ? t->width - 1 - x : x;
    if (t->planar) {
        size_t at = (size_t)y * t->width + ox;
        t->buf[at] = r, t->buf[t->plane + at] = g, t->buf[2 * t->plane + at] = b;
    } else {
        uint8_t *q = t->buf + (size_t)y * t->stride + (size_t)ox * 3;
        q[0] = r, q[1] = g, q[2] = b;
    }
}

/* Row y of a target from `line` (out_w interleaved pixels): ``store`` for a whole row,
 * its layout decided once per row rather than per pixel (a quarter of a horizontal pass's
 * time went to per-pixel stores into planes). */
static void store_line(const target *t, int y, const uint8_t *line, int out_w) {
    if (!t->planar) {
        uint8_t *q = t->buf + (size_t)y * t->stride;
        if (!t->flip) {
            memcpy(q, line, (size_t)out_w * 3);
            return;
        }
        for (int x = 0; x < out_w; x++) {
            uint8_t *o = q + (size_t)(t->width - 1 - x) * 3;
            o[0] = line[3 * x], o[1] = line[3 * x + 1], o[2] = line[3 * x + 2];
        }
        return;
    }
    uint8_t *r = t->buf + (size_t)y * t->width, *g = r + t->plane, *b = g + t->plane;
    if (!t->flip) {
        for (int x = 0; x < out_w; x++)
            r[x] = line[3 * x], g[x] = line[3 * x + 1], b[x] = line[3 * x + 2];
        return;
    }
    for (int x = 0, o = t->width - 1; x < out_w; x++, o--)
        r[o] = line[3 * x], g[o] = line[3 * x + 1], b[o] = line[3 * x + 2];
}

/* The passes are compiled twice, for AVX2 and for any x86-64 (picked at run time, glibc's ifunc): the
 * same integer operations, so the same values, more of them per instruction with AVX2. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
#define PASS_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define PASS_CLONES
#endif

/* Rows 0 .. rows-1 of `in` resized horizontally (weights of `out_w` outputs). */
PASS_CLONES static void horizontal_pass(const uint8_t *in, size_t in_stride, int rows, int out_w, const int *first,
                            const int *count, const int32_t *w, int ksize, const target *t) {
    for (int y = 0; y < rows; y++) {
        const uint8_t *line = in + (size_t)y * in_stride;
        for (int x = 0; x < out_w; x++) {
            uint8_t px[3];
            taps_rgb(line + (size_t)first[x] * 3, w + (size_t)x * ksize, count[x], px);
            store(t, y, x, px[0], px[1], px[2]);
        }
    }
}

/* Whether the passes may use SSE4.1 and AVX2 here (set at import; LMDBFOLDER_NO_SIMD unsets them;
 * exact_vbmi, for AVX-512, below, LMDBFOLDER_NO_AVX512 unsets it alone). */
static int exact_sse41 = 0;
static int exact_avx2 = 0;

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define EXACT_AVX2 1
/* The vertical pass in AVX2, 16 bytes of a row at a time through all of an output row's
 * taps, two input rows per vpmaddwd pair with the weights split as in the horizontal pass
 * (HSPLIT): the same integer sums. The tail of a row (under 16 bytes) as the plain pass
 * does it. Returns 0 (having written nothing) without its row buffer. */
__attribute__((target("avx2"))) static int vertical_avx2(const uint8_t *in, size_t in_stride, int cols, int out_h,
                                                         const int *first, const int *count, const int32_t *w,
                                                         int ksize, const target *t) {
    size_t n = (size_t)cols * 3, blocks = n / 16 * 16;
    uint8_t *line = malloc(n + 32);
    if (!line)
        return 0;
    const __m256i half = _mm256_set1_epi32(1 << (RESIZE_BITS - 1));
    for (int y = 0; y < out_h; y++) {
        const int32_t *k = w + (size_t)y * ksize;
        const uint8_t *base = in + (size_t)first[y] * in_stride;
        int taps = count[y];
        for (size_t j = 0; j < blocks; j += 16) {
            __m256i acc0 = half, acc1 = half;
            for (int i = 0; i < taps; i += 2) {
                const uint8_t *ra = base + (size_t)i * in_stride + j;
                int32_t ka = k[i], kb = i + 1 < taps ? k[i + 1] : 0;
                const uint8_t *rb = i + 1 < taps ? ra + in_stride : ra;
                __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)ra));
                __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)rb));
                __m256i lo = _mm256_set1_epi32(int16_pair(weight_lo(ka), weight_lo(kb)));
                __m256i hi = _mm256_set1_epi32(int16_pair(weight_hi(ka), weight_hi(kb)));
                __m256i p0 = _mm256_unpacklo_epi16(a, b), p1 = _mm256_unpackhi_epi16(a, b);
                acc0 = _mm256_add_epi32(acc0, _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(p0, hi), HSPLIT),
                                                               _mm256_madd_epi16(p0, lo)));
                acc1 = _mm256_add_epi32(acc1, _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(p1, hi), HSPLIT),
                                                               _mm256_madd_epi16(p1, lo)));
            }
            /* acc0 holds bytes 0-3 and 8-11, acc1 4-7 and 12-15: packing them restores the order. */
            __m256i v = _mm256_packs_epi32(_mm256_srai_epi32(acc0, RESIZE_BITS), _mm256_srai_epi32(acc1, RESIZE_BITS));
            v = _mm256_permute4x64_epi64(_mm256_packus_epi16(v, v), 0x08);
            _mm_storeu_si128((__m128i *)(line + j), _mm256_castsi256_si128(v));
        }
        for (size_t j = blocks; j < n; j++) {
            int32_t acc = 1 << (RESIZE_BITS - 1);
            const uint8_t *p = base + j;
            for (int i = 0; i < taps; i++, p += in_stride)
                acc += *p * k[i];
            line[j] = clip8(acc);
        }
        store_line(t, y, line, cols);
    }
    free(line);
    return 1;
}
#endif

#ifdef EXACT_AVX2
#define VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")))
/* Whether the AVX-512 passes may run here (VBMI and VNNI too; set at import, unset by
 * LMDBFOLDER_NO_AVX512 or LMDBFOLDER_NO_SIMD). */
static int exact_vbmi = 0;

/* The vpermb indices that take a block of m <= 16 pixels of an interleaved line to where a
 * target wants them: interleaved or split into planes (16 bytes each), mirrored or not (output
 * pixel j of the block is input pixel j, or m - 1 - j: the block then lands at the row's
 * other end). */
static void line_order(int planar, int flip, int m, uint8_t order[64]) {
    memset(order, 0, 64);
    for (int j = 0; j < m; j++)
        for (int c = 0; c < 3; c++)
            order[planar ? 16 * c + j : 3 * j + c] = (uint8_t)(3 * (flip ? m - 1 - j : j) + c);
}

/* store_line with byte permutes: a mirrored interleaved row and a row split into planes
 * (mirrored or not) sixteen pixels at a time, where store_line moves them one by one (a
 * twentieth of a fused sample's time went to its mirrored rows). The same bytes. `whole`
 * and `last`: line_order's indices for a block of 16 and for the row's last block. */
VBMI static void store_line_vbmi(const target *t, int y, const uint8_t *line, int out_w, const uint8_t *whole,
                                 const uint8_t *last) {
    if (!t->planar && !t->flip) {
        memcpy(t->buf + (size_t)y * t->stride, line, (size_t)out_w * 3);
        return;
    }
    const __m512i full = _mm512_loadu_si512(whole);
    for (int x = 0; x < out_w; x += 16) {
        int m = out_w - x < 16 ? out_w - x : 16;
        __mmask64 bytes = (1ULL << (3 * m)) - 1;
        __m512i v = _mm512_permutexvar_epi8(m == 16 ? full : _mm512_loadu_si512(last),
                                            _mm512_maskz_loadu_epi8(bytes, line + 3 * (size_t)x));
        size_t at = t->flip ? (size_t)(t->width - x - m) : (size_t)x;
        if (!t->planar) {
            uint8_t *q = t->buf + (size_t)y * t->stride + 3 * at;
            if (m == 16) { /* 48 bytes in two plain stores (masked ones are slow on some CPUs) */
                _mm256_storeu_si256((__m256i *)q, _mm512_castsi512_si256(v));
                _mm_storeu_si128((__m128i *)(q + 32), _mm512_extracti32x4_epi32(v, 2));
            } else {
                _mm512_mask_storeu_epi8(q, bytes, v);
            }
            continue;
        }
        uint8_t *r = t->buf + (size_t)y * t->width + at, *g = r + t->plane, *b = g + t->plane;
        if (m == 16) {
            _mm_storeu_si128((__m128i *)r, _mm512_castsi512_si128(v));
            _mm_storeu_si128((__m128i *)g, _mm512_extracti32x4_epi32(v, 1));
            _mm_storeu_si128((__m128i *)b, _mm512_extracti32x4_epi32(v, 2));
        } else {
            __mmask16 keep = (__mmask16)((1u << m) - 1);
            _mm_mask_storeu_epi8(r, keep, _mm512_castsi512_si128(v));
            _mm_mask_storeu_epi8(g, keep, _mm512_extracti32x4_epi32(v, 1));
            _mm_mask_storeu_epi8(b, keep, _mm512_extracti32x4_epi32(v, 2));
        }
    }
}

/* vertical_avx2 with 32 bytes of a row per step and vpdpwssd (the multiply-add and its sum
 * in one instruction); the row's tail by masked loads. The same integer sums. */
VBMI static int vertical_vbmi(const uint8_t *in, size_t in_stride, int cols, int out_h, const int *first,
                              const int *count, const int32_t *w, int ksize, const target *t) {
    size_t n = (size_t)cols * 3;
    uint8_t *line = malloc(n + 32); /* room for a whole last step */
    if (!line)
        return 0;
    const __m512i half = _mm512_set1_epi32(1 << (RESIZE_BITS - 1)), zero = _mm512_setzero_si512();
    uint8_t whole[64], last[64];
    line_order(t->planar, t->flip, 16, whole);
    line_order(t->planar, t->flip, cols % 16 ? cols % 16 : 16, last);
    /* Each row's pairs of taps: the two rows' offsets and the weights' halves as vpdpwssd
     * takes them (the same for every step along the row). */
    int pairs_max = (ksize + 1) / 2;
    size_t *off = malloc(sizeof(size_t) * 2 * (size_t)pairs_max);
    int32_t *klo = malloc(sizeof(int32_t) * 2 * (size_t)pairs_max), *khi = klo ? klo + pairs_max : NULL;
    if (!off || !klo) {
        free(line), free(off), free(klo);
        return 0;
    }
    for (int y = 0; y < out_h; y++) {
        const int32_t *k = w + (size_t)y * ksize;
        const uint8_t *base = in + (size_t)first[y] * in_stride;
        int taps = count[y], pairs = (taps + 1) / 2;
        for (int q = 0; q < pairs; q++) {
            int i = 2 * q;
            int32_t ka = k[i], kb = i + 1 < taps ? k[i + 1] : 0;
            off[2 * q] = (size_t)i * in_stride, off[2 * q + 1] = (size_t)(i + 1 < taps ? i + 1 : i) * in_stride;
            klo[q] = int16_pair(weight_lo(ka), weight_lo(kb));
            khi[q] = int16_pair(weight_hi(ka), weight_hi(kb));
        }
        for (size_t j = 0; j < n; j += 32) {
            __mmask32 m = n - j >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (n - j)) - 1);
            __m512i lo0 = half, lo1 = half, hi0 = zero, hi1 = zero;
            for (int q = 0; q < pairs; q++) {
                __m512i a = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, base + off[2 * q] + j));
                __m512i b = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, base + off[2 * q + 1] + j));
                __m512i lo = _mm512_set1_epi32(klo[q]), hi = _mm512_set1_epi32(khi[q]);
                __m512i p0 = _mm512_unpacklo_epi16(a, b), p1 = _mm512_unpackhi_epi16(a, b);
                lo0 = _mm512_dpwssd_epi32(lo0, p0, lo), hi0 = _mm512_dpwssd_epi32(hi0, p0, hi);
                lo1 = _mm512_dpwssd_epi32(lo1, p1, lo), hi1 = _mm512_dpwssd_epi32(hi1, p1, hi);
            }
            /* clip8, then bytes: the first sums hold bytes 0-3, 8-11, 16-19 and 24-27 of the
             * step, the second 4-7, 12-15, ...: interleaving their 4-byte groups restores the order. */
            __m512i s0 = _mm512_add_epi32(_mm512_slli_epi32(hi0, HSPLIT), lo0);
            __m512i s1 = _mm512_add_epi32(_mm512_slli_epi32(hi1, HSPLIT), lo1);
            __m128i x0 = _mm512_cvtusepi32_epi8(_mm512_max_epi32(_mm512_srai_epi32(s0, RESIZE_BITS), zero));
            __m128i x1 = _mm512_cvtusepi32_epi8(_mm512_max_epi32(_mm512_srai_epi32(s1, RESIZE_BITS), zero));
            _mm_storeu_si128((__m128i *)(line + j), _mm_unpacklo_epi32(x0, x1));
            _mm_storeu_si128((__m128i *)(line + j + 16), _mm_unpackhi_epi32(x0, x1));
        }
        store_line_vbmi(t, y, line, cols, whole, last);
    }
    free(line), free(off), free(klo);
    return 1;
}
#endif

/* Columns 0 .. cols-1 of `in` resized vertically (weights of `out_h` outputs;
 * first[] counts rows of `in`). Row by row into `acc` (3 * cols int32), so the
 * inner loop runs along a row, which the compiler vectorises. */
PASS_CLONES static void vertical_pass(const uint8_t *in, size_t in_stride, int cols, int out_h, const int *first,
                          const int *count, const int32_t *w, int ksize, int32_t *acc, const target *t) {
#ifdef EXACT_AVX2
    if (exact_vbmi && vertical_vbmi(in, in_stride, cols, out_h, first, count, w, ksize, t))
        return;
    if (exact_avx2 && vertical_avx2(in, in_stride, cols, out_h, first, count, w, ksize, t))
        return;
#endif
    size_t n = (size_t)cols * 3;
    uint8_t *line = malloc(n); /* without it, pixel by pixel */
    for (int y = 0; y < out_h; y++) {
        const int32_t *k = w + (size_t)y * ksize;
        const uint8_t *row = in + (size_t)first[y] * in_stride;
        for (size_t j = 0; j < n; j++)
            acc[j] = 1 << (RESIZE_BITS - 1);
        for (int i = 0; i < count[y]; i++, row += in_stride) {
            int32_t ki = k[i];
            for (size_t j = 0; j < n; j++)
                acc[j] += row[j] * ki;
        }
        if (line) {
            for (size_t j = 0; j < n; j++)
                line[j] = clip8(acc[j]);
            store_line(t, y, line, cols);
        } else {
            for (int x = 0; x < cols; x++)
                store(t, y, x, clip8(acc[3 * x]), clip8(acc[3 * x + 1]), clip8(acc[3 * x + 2]));
        }
    }
    free(line);
}

/* horizontal_pass's result, computed as a vertical pass over the transposed rows (the
 * same sums in the same order, so the same values): the vertical pass's inner loop runs
 * along memory and vectorises, the horizontal one's gathers taps and does not. Returns 0
 * (having written nothing) when its buffers cannot be had; the caller then runs
 * horizontal_pass. */
static int horizontal_by_transpose(const uint8_t *in, size_t in_stride, int rows, int width, int out_w,
                                   const int *first, const int *count, const int32_t *w, int ksize, const target *t) {
    size_t col = (size_t)rows * 3;
    uint8_t *cols = malloc((size_t)width * col), *mid = malloc((size_t)out_w * col);
    int32_t *acc = malloc(sizeof(int32_t) * col);
    if (!cols || !mid || !acc) {
        free(cols), free(mid), free(acc);
        return 0;
    }
    for (int y = 0; y < rows; y++) {
        const uint8_t *p = in + (size_t)y * in_stride;
        uint8_t *q = cols + (size_t)y * 3;
        for (int x = 0; x < width; x++, p += 3, q += col)
            q[0] = p[0], q[1] = p[1], q[2] = p[2];
    }
    target across = {mid, col, rows, 0, 0, 0};
    vertical_pass(cols, col, rows, out_w, first, count, w, ksize, acc, &across);
    for (int y = 0; y < rows; y++) {
        const uint8_t *p = mid + (size_t)y * 3;
        for (int x = 0; x < out_w; x++, p += col)
            store(t, y, x, p[0], p[1], p[2]);
    }
    free(cols), free(mid), free(acc);
    return 1;
}


#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <smmintrin.h>
#define EXACT_SSE41 1
/* Output pixels [x0, x1) of one row of the horizontal pass into `line`, the three channels
 * of a tap in one vector: the same integer sums as the scalar loop (so Pillow's values); a
 * tap reads 4 bytes, so the caller keeps to outputs whose last tap is not the row's last pixel. */
__attribute__((target("sse4.1"))) static void hrow_sse41(const uint8_t *row, int x0, int x1, const int *first,
                                                          const int *count, const int32_t *w, int ksize,
                                                          uint8_t *line) {
    const __m128i half = _mm_set1_epi32(1 << (RESIZE_BITS - 1));
    for (int x = x0; x < x1; x++) {
        const int32_t *k = w + (size_t)x * ksize;
        const uint8_t *p = row + (size_t)first[x] * 3;
        __m128i acc = half;
        for (int i = 0; i < count[x]; i++, p += 3) {
            int32_t four;
            memcpy(&four, p, 4);
            __m128i v = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(four));
            acc = _mm_add_epi32(acc, _mm_mullo_epi32(v, _mm_set1_epi32(k[i])));
        }
        acc = _mm_srai_epi32(acc, RESIZE_BITS);
        __m128i bytes = _mm_packus_epi16(_mm_packs_epi32(acc, acc), _mm_setzero_si128());
        int32_t out = _mm_cvtsi128_si32(bytes);
        memcpy(line + 3 * (size_t)x, &out, 3);
    }
}


/* The AVX2 horizontal pass: four taps of one output pixel per vpmaddwd pair instead of
 * one tap per 32-bit multiply (weights split as HSPLIT says). */

/* Each output's taps in groups of four, as the vectors vpmaddwd takes: per group, the low
 * halves then the high halves, each 16 int16 = (k0, k1) x 4 in the lower 128 bits and
 * (k2, k3) x 4 in the upper (taps past count are 0). */
static int16_t *avx2_weights(int out_w, const int *count, const int32_t *w, int ksize, int groups) {
    int16_t *c = calloc((size_t)out_w * (size_t)groups * 32, sizeof(int16_t));
    if (!c)
        return NULL;
    for (int x = 0; x < out_w; x++)
        for (int t = 0; t < count[x] && t < 4 * groups; t++) {
            int32_t k = w[(size_t)x * ksize + t];
            int16_t hi = weight_hi(k), lo = weight_lo(k);
            int16_t *g = c + ((size_t)x * groups + t / 4) * 32;
            int lane = (t / 2) % 2, odd = t % 2;
            for (int ch = 0; ch < 4; ch++) {
                g[lane * 8 + ch * 2 + odd] = lo;
                g[16 + lane * 8 + ch * 2 + odd] = hi;
            }
        }
    return c;
}

/* Output pixels [0, x1) of two rows (row0 into line0, row1 into line1; see HSPLIT), each
 * output's weights loaded once for both and the two rows' sums finished together. A group
 * reads 16 bytes at its first tap and 16 at its third: the caller keeps to outputs whose
 * reads stay in the row. */
__attribute__((target("avx2"))) static void hrow2_avx2(const uint8_t *row0, const uint8_t *row1, int x1,
                                                       const int *first, const int16_t *c, int groups, uint8_t *line0,
                                                       uint8_t *line1) {
    const __m256i pairs = _mm256_setr_epi8(0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1, 0, -1, 3, -1,
                                           1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1);
    const __m256i half = _mm256_set1_epi32(1 << (RESIZE_BITS - 1));
    for (int x = 0; x < x1; x++) {
        size_t at = (size_t)first[x] * 3;
        const uint8_t *p = row0 + at, *q = row1 + at;
        const int16_t *k = c + (size_t)x * groups * 32;
        __m256i lo0 = _mm256_setzero_si256(), hi0 = lo0, lo1 = lo0, hi1 = lo0;
        for (int g = 0; g < groups; g++, p += 12, q += 12, k += 32) {
            __m256i kl = _mm256_loadu_si256((const __m256i *)k), kh = _mm256_loadu_si256((const __m256i *)(k + 16));
            __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                                _mm_loadu_si128((const __m128i *)(p + 6)), 1);
            __m256i u = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)q)),
                                                _mm_loadu_si128((const __m128i *)(q + 6)), 1);
            v = _mm256_shuffle_epi8(v, pairs);
            u = _mm256_shuffle_epi8(u, pairs);
            lo0 = _mm256_add_epi32(lo0, _mm256_madd_epi16(v, kl));
            hi0 = _mm256_add_epi32(hi0, _mm256_madd_epi16(v, kh));
            lo1 = _mm256_add_epi32(lo1, _mm256_madd_epi16(u, kl));
            hi1 = _mm256_add_epi32(hi1, _mm256_madd_epi16(u, kh));
        }
        __m256i s0 = _mm256_add_epi32(_mm256_slli_epi32(hi0, HSPLIT), lo0);
        __m256i s1 = _mm256_add_epi32(_mm256_slli_epi32(hi1, HSPLIT), lo1);
        /* lanes: [row0's taps 0-1 | row1's taps 0-1] + [row0's taps 2-3 | row1's taps 2-3] */
        __m256i acc = _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
        acc = _mm256_srai_epi32(_mm256_add_epi32(acc, half), RESIZE_BITS);
        __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(acc, acc), _mm256_setzero_si256());
        int32_t out0 = _mm256_cvtsi256_si32(bytes), out1 = _mm_cvtsi128_si32(_mm256_extracti128_si256(bytes, 1));
        memcpy(line0 + 3 * (size_t)x, &out0, 3);
        memcpy(line1 + 3 * (size_t)x, &out1, 3);
    }
}

/* Output pixels [x0, x1) of one row into `line`, the plain loop (the outputs whose taps
 * reach the row's last pixel, which the vector loads would read past). */
static void horizontal_tail(const uint8_t *row, int x0, int x1, const int *first, const int *count, const int32_t *w,
                            int ksize, uint8_t *line) {
    for (int x = x0; x < x1; x++)
        taps_rgb(row + (size_t)first[x] * 3, w + (size_t)x * ksize, count[x], line + 3 * (size_t)x);
}

/* horizontal_pass in vectors (AVX2 where it runs, else SSE4.1) for the outputs whose taps
 * end before the row's last pixel (first[] and first + count grow with x: the outputs before
 * the first that reaches it), the plain loop for the rest, through a row buffer (two rows'
 * with AVX2). Returns 0 (having written nothing) without the buffer. */
static int horizontal_simd(const uint8_t *in, size_t in_stride, int rows, int width, int out_w, const int *first,
                            const int *count, const int32_t *w, int ksize, const target *t) {
    uint8_t *line = malloc((size_t)6 * (size_t)out_w + 1); /* two rows' lines */
    if (!line)
        return 0;
    int vec_end = 0;
    while (vec_end < out_w && first[vec_end] + count[vec_end] < width)
        vec_end++;
    /* AVX2 (when it runs here) for the outputs whose groups' reads end inside the row,
     * SSE4.1 for the next ones up to vec_end, the plain loop for the rest. */
    int most = 1, avx_end = 0;
    for (int x = 0; x < out_w; x++)
        most = count[x] > most ? count[x] : most;
    int groups = (most + 3) / 4; /* ksize bounds count loosely: a group fewer for most kernels */
    int16_t *c = NULL;
    if (exact_avx2 && (c = avx2_weights(out_w, count, w, ksize, groups)) != NULL)
        while (avx_end < vec_end && (size_t)(first[avx_end] + 4 * (groups - 1)) * 3 + 22 <= (size_t)width * 3)
            avx_end++;
    for (int y = 0; y < rows; y++) {
        const uint8_t *row = in + (size_t)y * in_stride;
        if (avx_end && y + 1 < rows) {
            /* Two rows: the second row's line after the first's, finished below. */
            uint8_t *next = line + 3 * (size_t)out_w;
            hrow2_avx2(row, row + in_stride, avx_end, first, c, groups, line, next);
            hrow_sse41(row + in_stride, avx_end, vec_end, first, count, w, ksize, next);
            horizontal_tail(row + in_stride, vec_end, out_w, first, count, w, ksize, next);
            hrow_sse41(row, avx_end, vec_end, first, count, w, ksize, line);
            horizontal_tail(row, vec_end, out_w, first, count, w, ksize, line);
            store_line(t, y, line, out_w);
            store_line(t, ++y, next, out_w);
            continue;
        }
        if (avx_end) /* the last of an odd number of rows: its sums twice, one kept */
            hrow2_avx2(row, row, avx_end, first, c, groups, line, line + 3 * (size_t)out_w);
        hrow_sse41(row, avx_end, vec_end, first, count, w, ksize, line);
        horizontal_tail(row, vec_end, out_w, first, count, w, ksize, line);
        store_line(t, y, line, out_w);
    }
    free(line), free(c);
    return 1;
}
#endif

/* The horizontal pass with AVX-512 VBMI byte permutes (where the CPU has them): each row
 * split into its R, G and B planes, then sixteen outputs of a plane at once. The taps of
 * sixteen neighbouring outputs lie in a 64-byte window of the plane while the width shrinks
 * by under ~3.5x (RandomResizedCrop's usual case); vpermb gathers each output's pair of taps
 * from it as the int16 pairs vpdpwssd multiplies and sums, the weights split as HSPLIT says,
 * so every sum is the scalar loop's integer (int32 sums wrap alike in any order), and the
 * rounding and clipping are Pillow's clip8. Sixteen outputs per vector, every lane useful,
 * instead of one output's three channels per vector: 224 rows of a 365-wide crop to 224
 * took 0.056 ms instead of AVX2's 0.092. */
#ifdef EXACT_AVX2
/* Per block of 16 outputs: its window's first input pixel, and per pair of taps the
 * vpermb indices (64 bytes: output i's taps at bytes 4i and 4i + 2, the rest 0) and the low
 * and high halves of the weights (32 int16 each, output i's pair at 2i). */
typedef struct {
    int blocks, pairs;
    int *base;
    uint8_t *idx;
    int16_t *lo, *hi;
} vbmi_plan;

static void vbmi_free(vbmi_plan *p) { free(p->base), free(p->idx), free(p->lo), free(p->hi); }

/* 0 (nothing to free) where some block's taps do not fit its window, or no memory. */
static int vbmi_plan_make(int out_w, const int *first, const int *count, const int32_t *w, int ksize, vbmi_plan *p) {
    int most = 1;
    for (int x = 0; x < out_w; x++)
        most = count[x] > most ? count[x] : most;
    p->blocks = (out_w + 15) / 16, p->pairs = (most + 1) / 2;
    size_t n = (size_t)p->blocks * (size_t)p->pairs;
    p->base = malloc(sizeof(int) * (size_t)p->blocks);
    p->idx = calloc(n * 64, 1);
    p->lo = calloc(n * 32, sizeof(int16_t)), p->hi = calloc(n * 32, sizeof(int16_t));
    if (!p->base || !p->idx || !p->lo || !p->hi) {
        vbmi_free(p);
        return 0;
    }
    for (int b = 0; b < p->blocks; b++) {
        int base = first[16 * b];
        p->base[b] = base;
        for (int i = 0; i < 16 && 16 * b + i < out_w; i++) {
            int x = 16 * b + i;
            for (int t = 0; t < count[x]; t++) {
                int rel = first[x] + t - base;
                if (rel < 0 || rel >= 64) {
                    vbmi_free(p);
                    return 0;
                }
                size_t at = (size_t)b * p->pairs + t / 2;
                int32_t k = w[(size_t)x * ksize + t];
                p->idx[at * 64 + 4 * i + 2 * (t % 2)] = (uint8_t)rel;
                p->lo[at * 32 + 2 * i + t % 2] = weight_lo(k);
                p->hi[at * 32 + 2 * i + t % 2] = weight_hi(k);
            }
        }
    }
    return 1;
}

/* One plane's row (`width` bytes) into out[0 .. out_w). */
VBMI static void hplane_vbmi(const uint8_t *plane, int width, const vbmi_plan *p, int out_w, uint8_t *out) {
    const __m512i half = _mm512_set1_epi32(1 << (RESIZE_BITS - 1)), zero = _mm512_setzero_si512();
    for (int b = 0; b < p->blocks; b++) {
        int avail = width - p->base[b]; /* > 0: every block has an output, whose first tap is in the row */
        __m512i win = _mm512_maskz_loadu_epi8(avail >= 64 ? ~0ULL : (1ULL << avail) - 1, plane + p->base[b]);
        __m512i lo = half, hi = zero;
        size_t at = (size_t)b * p->pairs;
        for (int j = 0; j < p->pairs; j++, at++) {
            __m512i v = _mm512_maskz_permutexvar_epi8(0x5555555555555555ULL, _mm512_loadu_si512(p->idx + at * 64), win);
            lo = _mm512_dpwssd_epi32(lo, v, _mm512_loadu_si512(p->lo + at * 32)); /* lo += vpmaddwd(v, k) */
            hi = _mm512_dpwssd_epi32(hi, v, _mm512_loadu_si512(p->hi + at * 32));
        }
        __m512i s = _mm512_add_epi32(_mm512_slli_epi32(hi, HSPLIT), lo);
        s = _mm512_max_epi32(_mm512_srai_epi32(s, RESIZE_BITS), zero); /* clip8: <= 0 -> 0, then >= 256 -> 255 */
        __m128i bytes = _mm512_cvtusepi32_epi8(s);
        _mm_storeu_si128((__m128i *)(out + 16 * b), bytes); /* out has room for whole blocks */
    }
}

/* Pixels 0 .. n-1 of an RGB row into three planes; `split`: line_order's indices for a
 * block of 16 into planes, unmirrored. */
VBMI static void split_rgb_vbmi(const uint8_t *in, int n, uint8_t *r, uint8_t *g, uint8_t *b, const uint8_t *split) {
    const __m512i idx = _mm512_loadu_si512(split);
    for (int x = 0; x < n; x += 16) {
        int m = n - x < 16 ? n - x : 16;
        __m512i v = _mm512_permutexvar_epi8(idx, _mm512_maskz_loadu_epi8((1ULL << (3 * m)) - 1, in + 3 * (size_t)x));
        /* Plain stores (masked ones are slow on some CPUs): each plane has 16 bytes of room. */
        _mm_storeu_si128((__m128i *)(r + x), _mm512_castsi512_si128(v));
        _mm_storeu_si128((__m128i *)(g + x), _mm512_extracti32x4_epi32(v, 1));
        _mm_storeu_si128((__m128i *)(b + x), _mm512_extracti32x4_epi32(v, 2));
    }
}

/* The vpermb indices that interleave a block of m <= 16 pixels from three planes (held in
 * the vector's first three 128-bit lanes), mirrored or not: output pixel j of the block is
 * input pixel j, or m - 1 - j mirrored (the block then lands at the row's other end). */
static void interleave_order(int m, int flip, uint8_t order[64]) {
    memset(order, 0, 64);
    for (int j = 0; j < m; j++)
        for (int c = 0; c < 3; c++)
            order[3 * j + c] = (uint8_t)(16 * c + (flip ? m - 1 - j : j));
}

/* Row y of a target from three planes of n pixels (``store_line`` for plane-ordered
 * lines); `whole` and `last` are interleave_order's indices for a block of 16 and for the
 * row's last block. */
VBMI static void store_planes(const target *t, int y, const uint8_t *r, const uint8_t *g, const uint8_t *b, int n,
                              const uint8_t *whole, const uint8_t *last) {
    if (t->planar) {
        uint8_t *q[3] = {t->buf + (size_t)y * t->width, NULL, NULL};
        q[1] = q[0] + t->plane, q[2] = q[1] + t->plane;
        const uint8_t *src[3] = {r, g, b};
        for (int c = 0; c < 3; c++) {
            if (!t->flip)
                memcpy(q[c], src[c], (size_t)n);
            else
                for (int x = 0, o = t->width - 1; x < n; x++, o--)
                    q[c][o] = src[c][x];
        }
        return;
    }
    uint8_t *row = t->buf + (size_t)y * t->stride;
    const __m512i full = _mm512_loadu_si512(whole);
    for (int x = 0; x < n; x += 16) {
        int m = n - x < 16 ? n - x : 16;
        __mmask16 keep = m == 16 ? 0xFFFF : (__mmask16)((1u << m) - 1);
        __m512i v = _mm512_castsi128_si512(_mm_maskz_loadu_epi8(keep, r + x));
        v = _mm512_inserti32x4(v, _mm_maskz_loadu_epi8(keep, g + x), 1);
        v = _mm512_inserti32x4(v, _mm_maskz_loadu_epi8(keep, b + x), 2);
        size_t at = t->flip ? (size_t)(t->width - x - m) : (size_t)x;
        if (m == 16) { /* 48 bytes, in two plain stores */
            __m512i out = _mm512_permutexvar_epi8(full, v);
            _mm256_storeu_si256((__m256i *)(row + 3 * at), _mm512_castsi512_si256(out));
            _mm_storeu_si128((__m128i *)(row + 3 * at + 32), _mm512_extracti32x4_epi32(out, 2));
        } else {
            _mm512_mask_storeu_epi8(row + 3 * at, (1ULL << (3 * m)) - 1, _mm512_permutexvar_epi8(_mm512_loadu_si512(last), v));
        }
    }
}

/* horizontal_pass's result by planes; 0 (having written nothing) where the plan cannot be
 * made (a block's taps outside its window) or without memory. */
static int horizontal_vbmi(const uint8_t *in, size_t in_stride, int rows, int width, int out_w, const int *first,
                           const int *count, const int32_t *w, int ksize, const target *t) {
    vbmi_plan p;
    if (!vbmi_plan_make(out_w, first, count, w, ksize, &p))
        return 0;
    /* Each plane and each output plane with room for a whole last block of 16. */
    size_t in_plane = (size_t)width + 16, out_plane = (size_t)out_w + 16;
    uint8_t *planes = malloc(3 * in_plane), *line = malloc(3 * out_plane);
    if (!planes || !line) {
        free(planes), free(line), vbmi_free(&p);
        return 0;
    }
    uint8_t whole[64], last[64], split[64];
    interleave_order(16, t->flip, whole);
    interleave_order(out_w % 16 ? out_w % 16 : 16, t->flip, last);
    line_order(1, 0, 16, split);
    for (int y = 0; y < rows; y++) {
        split_rgb_vbmi(in + (size_t)y * in_stride, width, planes, planes + in_plane, planes + 2 * in_plane, split);
        for (int c = 0; c < 3; c++)
            hplane_vbmi(planes + c * in_plane, width, &p, out_w, line + c * out_plane);
        store_planes(t, y, line, line + out_plane, line + 2 * out_plane, out_w, whole, last);
    }
    free(planes), free(line), vbmi_free(&p);
    return 1;
}
#endif

/* The horizontal pass by the fastest way measured: in AVX2 (four taps per vpmaddwd pair,
 * two rows at a time) or SSE4.1 vectors (a tap of three channels per vector), for the
 * bilinear and the bicubic kernels alike; the transposed pass, then the plain loop, where
 * neither can run. All of them make the same integer sums, so the same values. */
static void horizontal_resize(const uint8_t *in, size_t in_stride, int rows, int width, int out_w, const int *first,
                       const int *count, const int32_t *w, int ksize, const target *t) {
#ifdef EXACT_AVX2
    if (exact_vbmi && horizontal_vbmi(in, in_stride, rows, width, out_w, first, count, w, ksize, t))
        return;
#endif
#ifdef EXACT_SSE41
    if (exact_sse41 && horizontal_simd(in, in_stride, rows, width, out_w, first, count, w, ksize, t))
        return;
#endif
    if (!horizontal_by_transpose(in, in_stride, rows, width, out_w, first, count, w, ksize, t))
        horizontal_pass(in, in_stride, rows, out_w, first, count, w, ksize, t);
}

static void copy_pass(const uint8_t *in, size_t in_stride, int rows, int cols, const target *t) {
    for (int y = 0; y < rows; y++)
        for (int x = 0; x < cols; x++) {
            const uint8_t *p = in + (size_t)y * in_stride + (size_t)x * 3;
            store(t, y, x, p[0], p[1], p[2]);
        }
}

PyDoc_STRVAR(resize_bilinear_doc,
"resize_bilinear(src, row_pixels, left, width, height, out_w, out_h, dst, tmp, planar, flip, order)\n\n"
"Resize columns left .. left+width-1 of rows 0 .. height-1 of the RGB rows in\n"
"``src`` (``row_pixels`` pixels each) to out_w x out_h as Pillow's\n"
"resize(BILINEAR) does, into ``dst``: H x W x 3 when ``planar`` is false, else\n"
"3 planes of H x W; mirrored left-right when ``flip``. ``tmp`` is scratch of at\n"
"least 3 * max(out_w * height, width * out_h) bytes. ``order`` is the installed\n"
"Pillow's order of the two passes: 0, horizontal first (Pillow <= 12); 1, vertical\n"
"first when the height shrinks by more than twice what the width does (Pillow 13).\n"
"``cubic`` (optional, default false): Pillow's BICUBIC filter instead of BILINEAR.");

static PyObject *resize_bilinear(PyObject *self, PyObject *args) {
    Py_buffer src, dst, tmp;
    int row_pixels, left, width, height, out_w, out_h, planar, flip, order, cubic = 0;
    if (!PyArg_ParseTuple(args, "y*iiiiiiw*w*ppi|p", &src, &row_pixels, &left, &width, &height, &out_w, &out_h, &dst,
                          &tmp, &planar, &flip, &order, &cubic))
        return NULL;
    const char *problem = NULL;
    size_t tmp_need = 0;
    /* In 64 bits: left + width overflows an int for a box near INT_MAX. */
    if (width <= 0 || height <= 0 || out_w <= 0 || out_h <= 0 || left < 0 || row_pixels <= 0 ||
        (int64_t)left + (int64_t)width > (int64_t)row_pixels)
        problem = "the box is empty or outside the rows";
    else if ((tmp_need = (size_t)3 * ((size_t)out_w * (size_t)height > (size_t)width * (size_t)out_h
                                          ? (size_t)out_w * (size_t)height
                                          : (size_t)width * (size_t)out_h)) == 0)
        problem = "the box is empty";
    else if (order != 0 && order != 1)
        problem = "order must be 0 or 1";
    else if ((size_t)src.len < (size_t)row_pixels * 3 * (size_t)height)
        problem = "src is smaller than height rows";
    else if ((size_t)dst.len < (size_t)out_w * (size_t)out_h * 3)
        problem = "dst is too small";
    else if ((size_t)tmp.len < tmp_need)
        problem = "tmp is too small";
    int *xfirst = NULL, *xcount = NULL, *yfirst = NULL, *ycount = NULL;
    int32_t *xw = NULL, *yw = NULL, *acc = NULL;
    int xk = 0, yk = 0;
    if (!problem) {
        xk = bilinear_weights(width, out_w, cubic, &xfirst, &xcount, &xw);
        yk = bilinear_weights(height, out_h, cubic, &yfirst, &ycount, &yw);
        acc = malloc(sizeof(int32_t) * 3 * (size_t)(width > out_w ? width : out_w));
        if (!xk || !yk || !acc) {
            free(xfirst), free(xcount), free(xw), free(yfirst), free(ycount), free(yw), free(acc);
            PyBuffer_Release(&src), PyBuffer_Release(&dst), PyBuffer_Release(&tmp);
            return PyErr_NoMemory();
        }
    }
    if (problem) {
        PyBuffer_Release(&src), PyBuffer_Release(&dst), PyBuffer_Release(&tmp);
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *in = (const uint8_t *)src.buf + (size_t)left * 3;
    size_t in_stride = (size_t)row_pixels * 3;
    target final = {(uint8_t *)dst.buf, (size_t)out_w * 3, out_w, planar, flip, (size_t)out_w * out_h};
    /* Pillow skips a pass whose size does not change (its weights would be the identity). */
    int horizontal = out_w != width, vertical = out_h != height;
    int vertical_first = order == 1 && (height - out_h) > 0 && (height - out_h) > (width - out_w) * 2;
    if (vertical_first) {
        target mid = {(uint8_t *)tmp.buf, (size_t)width * 3, width, 0, 0, 0};
        vertical_pass(in, in_stride, width, out_h, yfirst, ycount, yw, yk, acc, horizontal ? &mid : &final);
        if (horizontal)
            horizontal_resize(mid.buf, mid.stride, out_h, width, out_w, xfirst, xcount, xw, xk, &final);
    } else if (horizontal) {
        /* only the rows the vertical pass reads */
        int row0 = yfirst[0], row1 = yfirst[out_h - 1] + ycount[out_h - 1];
        target mid = {(uint8_t *)tmp.buf, (size_t)out_w * 3, out_w, 0, 0, 0};
        if (!vertical) {
            horizontal_resize(in, in_stride, height, width, out_w, xfirst, xcount, xw, xk, &final);
        } else {
            horizontal_resize(in + (size_t)row0 * in_stride, in_stride, row1 - row0, width, out_w, xfirst, xcount, xw, xk,
                              &mid);
            for (int y = 0; y < out_h; y++)
                yfirst[y] -= row0;
            vertical_pass(mid.buf, mid.stride, out_w, out_h, yfirst, ycount, yw, yk, acc, &final);
        }
    } else if (vertical) {
        vertical_pass(in, in_stride, width, out_h, yfirst, ycount, yw, yk, acc, &final);
    } else {
        copy_pass(in, in_stride, height, width, &final);
    }
    Py_END_ALLOW_THREADS
    free(xfirst), free(xcount), free(xw), free(yfirst), free(ycount), free(yw), free(acc);
    PyBuffer_Release(&src), PyBuffer_Release(&dst), PyBuffer_Release(&tmp);
    Py_RETURN_NONE;
}


/* ---- A batch made without the GIL --------------------------------------------
 *
 * resize="native" (lmdbfolder.fused.RandomResizedCrop): each image of a batch is
 * one job, region decode -> bilinear resize -> its slot of the N x 3 x H x W
 * output, mirrored when asked, all in C. Jobs are added while the caller still
 * reads records and draws boxes; `threads - 1` threads started here take them
 * at once, and `finish` makes the rest on the calling thread with the GIL
 * released, then joins them. No Python object is touched without the GIL: each
 * job's payload is a buffer the Batch holds until it is finished.
 *
 * The resize: OpenCV's INTER_LINEAR geometry (half-pixel centres, edges
 * clamped), 8-bit weights; horizontal pass into planar rows of 8.8 fixed
 * point, vertical pass rounding to 8 bits. Its own documented pixels, not
 * OpenCV's or Pillow's (the tests hold it to a float model within one grey
 * level). Shrinking 2x or more is left to the caller (it aliases). */

#include <pthread.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <tmmintrin.h>
#endif

typedef struct {
    const uint8_t *data;
    Py_ssize_t len;
    int left, top, width, height, image_w, image_h, flip, k;
    int failed;
    char error[200];
} native_job;

typedef struct {
    uint8_t *region; size_t region_len;
    uint16_t *rows; size_t rows_len;
    int *xs; uint16_t *xw; size_t xs_len;
} native_scratch;

typedef struct {
    PyObject_HEAD
    Py_buffer out;
    int have_out;
    int out_h, out_w, capacity, threads;
    native_job *jobs;
    Py_buffer *payloads;
    int added, next, closed, finished, started;
    pthread_mutex_t lock;
    pthread_cond_t more;
    pthread_t *workers;
} BatchObject;

static int grow(void **p, size_t *have, size_t need) {
    if (*have >= need)
        return 1;
    void *q = realloc(*p, need);
    if (!q)
        return 0;
    *p = q, *have = need;
    return 1;
}

/* Source index and weight of each output coordinate (8-bit weights summing to 256):
 * sample o is in[first[o]] * (256 - w1[o]) + in[first[o] + 1] * w1[o], and first[o] + 1
 * is always inside (the last sample is its left neighbour at weight 256), except when
 * in == 1 (then w1 is 0 and the same sample is read twice). The output spans the
 * source window [start, start + span) of the `in` samples (0 and `in` for the whole
 * of them; a window in fractions of a sample when the image was decoded at a reduced
 * DCT scale, so that the crop is torchvision's box, not that box rounded). */
static void linear_taps(int in, int out, double start, double span, int *first, uint16_t *w1) {
    double scale = span / out;
    for (int o = 0; o < out; o++) {
        double f = start + (o + 0.5) * scale - 0.5;
        int i = (int)(f + 1.0) - 1; /* floor (f > -1); no libm call: this runs per image */
        int w = (int)((f - i) * 256.0 + 0.5);
        if (i < 0)
            i = 0, w = 0;
        if (i >= in - 1)
            i = in - 1, w = 0;
        if (w == 256)
            i++, w = 0;
        if (i == in - 1 && in > 1)
            i = in - 2, w = 256;
        first[o] = i;
        w1[o] = (uint16_t)w;
    }
}

/* The horizontal taps of a row, in output order (mirrored for a flip): byte offsets of
 * the left and right sample, and the weights as the SIMD pass wants them. */
typedef struct {
    int32_t left, right;
} htap;

static void native_hpass_scalar(const uint8_t *src, const htap *t, const uint16_t *w1s, int from, int out_w,
                                uint16_t *dst) {
    uint16_t *r = dst, *g = dst + out_w, *b = dst + 2 * out_w;
    for (int x = from; x < out_w; x++) {
        const uint8_t *p = src + t[x].left, *q = src + t[x].right;
        unsigned w1 = w1s[x], w0 = 256 - w1;
        r[x] = (uint16_t)(p[0] * w0 + q[0] * w1);
        g[x] = (uint16_t)(p[1] * w0 + q[1] * w1);
        b[x] = (uint16_t)(p[2] * w0 + q[2] * w1);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <tmmintrin.h>
#define NATIVE_SIMD 1
/* The same numbers as native_hpass_scalar, 4 outputs at a time (SSSE3): the two
 * neighbours of an output are 6 adjacent bytes (right == left + 3), shuffled into
 * (left, right) pairs per channel and multiplied by (w0, w1, w0, w1, w0, w1, 0, 0)
 * (`wvec`, 8 per output) with one pmaddwd. Each load reads 8 bytes from `left`: the
 * caller makes sure they are readable. Returns the first output not made. */
__attribute__((target("ssse3"))) static int native_hpass_ssse3(const uint8_t *src, const htap *t,
                                                               const int16_t *wvec, int out_w, uint16_t *dst) {
    const __m128i pairs = _mm_setr_epi8(0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1);
    const __m128i low16 = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    uint16_t *r = dst, *g = dst + out_w, *b = dst + 2 * out_w;
    int x = 0;
    for (; x + 4 <= out_w; x += 4) {
        __m128i s[4];
        for (int i = 0; i < 4; i++) {
            __m128i px = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)(src + t[x + i].left)), pairs);
            s[i] = _mm_madd_epi16(px, _mm_loadu_si128((const __m128i *)(wvec + 8 * (x + i)))); /* (R, G, B, 0) */
        }
        __m128i t0 = _mm_unpacklo_epi32(s[0], s[1]), t1 = _mm_unpacklo_epi32(s[2], s[3]);
        __m128i t2 = _mm_unpackhi_epi32(s[0], s[1]), t3 = _mm_unpackhi_epi32(s[2], s[3]);
        _mm_storel_epi64((__m128i *)(r + x), _mm_shuffle_epi8(_mm_unpacklo_epi64(t0, t1), low16));
        _mm_storel_epi64((__m128i *)(g + x), _mm_shuffle_epi8(_mm_unpackhi_epi64(t0, t1), low16));
        _mm_storel_epi64((__m128i *)(b + x), _mm_shuffle_epi8(_mm_unpacklo_epi64(t2, t3), low16));
    }
    return x;
}
#endif

static int simd_ok = -1;

static void native_hpass(const uint8_t *src, int simd, const htap *t, const uint16_t *w1s, const int16_t *wvec,
                         int out_w, uint16_t *dst) {
    int from = 0;
#ifdef NATIVE_SIMD
    if (simd)
        from = native_hpass_ssse3(src, t, wvec, out_w, dst);
#else
    (void)simd, (void)wvec;
#endif
    native_hpass_scalar(src, t, w1s, from, out_w, dst);
}

/* out = ((a * w0) >> 8 + (b * w1) >> 8 + 128) >> 8, every step in 16 bits (what
 * pmulhuw computes: x86-64 has it, SSE2, everywhere); a weight of 256 is a row alone. */
static void native_vblend(const uint16_t *a, const uint16_t *b, unsigned w1, uint8_t *dst, int n) {
    int i = 0;
    if (w1 == 0 || w1 == 256) {
        const uint16_t *only = w1 ? b : a;
        for (; i < n; i++)
            dst[i] = (uint8_t)((only[i] + 128u) >> 8);
        return;
    }
    uint16_t high0 = (uint16_t)((256 - w1) << 8), high1 = (uint16_t)(w1 << 8);
#if defined(__x86_64__) && defined(__GNUC__)
    const __m128i h0 = _mm_set1_epi16((short)high0), h1 = _mm_set1_epi16((short)high1), half = _mm_set1_epi16(128);
    for (; i + 16 <= n; i += 16) {
        __m128i lo = _mm_add_epi16(_mm_add_epi16(_mm_mulhi_epu16(_mm_loadu_si128((const __m128i *)(a + i)), h0),
                                                 _mm_mulhi_epu16(_mm_loadu_si128((const __m128i *)(b + i)), h1)),
                                   half);
        __m128i hi = _mm_add_epi16(_mm_add_epi16(_mm_mulhi_epu16(_mm_loadu_si128((const __m128i *)(a + i + 8)), h0),
                                                 _mm_mulhi_epu16(_mm_loadu_si128((const __m128i *)(b + i + 8)), h1)),
                                   half);
        _mm_storeu_si128((__m128i *)(dst + i), _mm_packus_epi16(_mm_srli_epi16(lo, 8), _mm_srli_epi16(hi, 8)));
    }
#endif
    for (; i < n; i++) {
        uint16_t p = (uint16_t)(((uint32_t)a[i] * high0) >> 16), q = (uint16_t)(((uint32_t)b[i] * high1) >> 16);
        dst[i] = (uint8_t)((uint16_t)(p + q + 128u) >> 8);
    }
}

/* Resize the crop (rows of `stride` bytes, `src` at its first pixel, readable up to
 * `limit`) into the three planes at `dst` (out_h x out_w each), mirrored left-right
 * when `flip`. Returns 0 when scratch memory ran out. */
typedef struct {
    double x, y, w, h; /* the source window, in samples of the crop (0, 0, crop_w, crop_h: all of it) */
} window;

static int native_resize(const uint8_t *src, const uint8_t *limit, size_t stride, int crop_w, int crop_h, int out_w,
                         int out_h, int flip, uint8_t *dst, native_scratch *s, window win) {
    size_t taps = (size_t)(out_w > out_h ? out_w : out_h);
    size_t need = taps * (2 * sizeof(int) + 3 * sizeof(uint16_t) + sizeof(htap) + 8 * sizeof(int16_t)) + 16;
    if (!grow((void **)&s->xs, &s->xs_len, need))
        return 0;
    int *xs = s->xs, *ys = xs + taps;
    htap *t = (htap *)(ys + taps);
    int16_t *wvec = (int16_t *)(t + taps);
    uint16_t *xw = (uint16_t *)(wvec + 8 * taps), *yw = xw + taps, *w1s = yw + taps;
    linear_taps(crop_w, out_w, win.x, win.w, xs, xw);
    linear_taps(crop_h, out_h, win.y, win.h, ys, yw);
    int32_t rightmost = 0;
    for (int x = 0; x < out_w; x++) {
        int from = flip ? out_w - 1 - x : x; /* a flip is the taps read backwards */
        t[x].left = 3 * xs[from];
        t[x].right = crop_w > 1 ? 3 * (xs[from] + 1) : 3 * xs[from];
        if (t[x].left > rightmost)
            rightmost = t[x].left;
        int16_t w1 = (int16_t)xw[from], w0 = (int16_t)(256 - xw[from]);
        int16_t *v = wvec + 8 * x;
        v[0] = v[2] = v[4] = w0, v[1] = v[3] = v[5] = w1, v[6] = v[7] = 0;
        w1s[x] = xw[from];
    }
    /* The SIMD pass reads 8 bytes at each left neighbour: where a row has them (every row
     * of a decoded region, which has room after it), and the neighbours are adjacent. */
    size_t last_read = (size_t)rightmost + 8;
    size_t row = (size_t)3 * out_w;
    if (!grow((void **)&s->rows, &s->rows_len, 2 * row * sizeof(uint16_t)))
        return 0;
    /* Two horizontally resized rows, kept by source row: the vertical pass walks down. */
    uint16_t *slot[2] = {s->rows, s->rows + row};
    int held[2] = {-1, -1};
    size_t plane = (size_t)out_w * out_h;
    for (int y = 0; y < out_h; y++) {
        int y0 = ys[y], y1 = crop_h > 1 ? y0 + 1 : y0;
        uint16_t *rows[2];
        for (int want = 0; want < 2; want++) {
            int r = want ? y1 : y0;
            int at = held[0] == r ? 0 : held[1] == r ? 1 : -1;
            if (at < 0) {
                at = (held[0] == y0 || held[0] == y1) ? 1 : 0; /* never evict the row still needed */
                const uint8_t *line = src + (size_t)r * stride;
                int simd = simd_ok > 0 && crop_w > 1 && line + last_read <= limit;
                native_hpass(line, simd, t, w1s, wvec, out_w, slot[at]);
                held[at] = r;
            }
            rows[want] = slot[at];
        }
        for (int c = 0; c < 3; c++)
            native_vblend(rows[0] + c * out_w, rows[1] + c * out_w, yw[y], dst + c * plane + (size_t)y * out_w, out_w);
    }
    return 1;
}

static void native_run_job(BatchObject *b, native_job *j, native_scratch *s) {
    size_t need = (size_t)3 * (size_t)j->image_w * (size_t)j->height;
    if (j->image_w <= 0 || j->height <= 0 || !grow((void **)&s->region, &s->region_len, need + 16)) {
        j->failed = 1;
        snprintf(j->error, sizeof j->error, "no memory for the region");
        return;
    }
    error_mgr err;
    Py_buffer out;
    memset(&out, 0, sizeof(out));
    out.buf = s->region, out.len = (Py_ssize_t)need;
    JDIMENSION x0 = 0, w0 = 0;
    enum outcome result = decode_into(j->data, (size_t)j->len, j->left, j->top, j->width, j->height, &out, j->image_w,
                                      j->image_h, &x0, &w0, &err);
    if (result != DONE || err.warned) {
        j->failed = 1;
        snprintf(j->error, sizeof j->error, "region decode: %s", result == LIBJPEG_ERROR || err.warned ? err.message : "not a case it takes");
        return;
    }
    size_t stride = (size_t)w0 * 3;
    const uint8_t *src = s->region + (size_t)(j->left - (int)x0) * 3;
    uint8_t *dst = (uint8_t *)b->out.buf + (size_t)j->k * 3 * (size_t)b->out_h * (size_t)b->out_w;
    window whole = {0.0, 0.0, (double)j->width, (double)j->height};
    if (!native_resize(src, s->region + need, stride, j->width, j->height, b->out_w, b->out_h, j->flip, dst, s, whole)) {
        j->failed = 1;
        snprintf(j->error, sizeof j->error, "no memory for the resize");
    }
}

/* Take jobs until the batch is closed and none is left. Called without the GIL. */
static void native_work(BatchObject *b) {
    native_scratch s;
    memset(&s, 0, sizeof(s));
    for (;;) {
        pthread_mutex_lock(&b->lock);
        while (b->next >= b->added && !b->closed)
            pthread_cond_wait(&b->more, &b->lock);
        if (b->next >= b->added) {
            pthread_mutex_unlock(&b->lock);
            break;
        }
        native_job *j = &b->jobs[b->next++];
        pthread_mutex_unlock(&b->lock);
        native_run_job(b, j, &s);
    }
    free(s.region), free(s.rows), free(s.xs);
}

static void *native_worker(void *arg) {
    native_work((BatchObject *)arg);
    return NULL;
}

/* Close the batch, make what is left on this thread, join the others. Without the GIL. */
static void native_close(BatchObject *b) {
    pthread_mutex_lock(&b->lock);
    b->closed = 1;
    pthread_cond_broadcast(&b->more);
    pthread_mutex_unlock(&b->lock);
    native_work(b);
    for (int t = 0; t < b->started; t++)
        pthread_join(b->workers[t], NULL);
    b->started = 0;
    b->finished = 1;
}

/* With the GIL, once no thread of the batch runs: let go of every buffer it holds. */
static void release_buffers(BatchObject *b) {
    for (int k = 0; b->payloads && k < b->added; k++)
        if (b->payloads[k].obj != NULL)
            PyBuffer_Release(&b->payloads[k]);
    if (b->have_out) {
        PyBuffer_Release(&b->out);
        b->have_out = 0;
    }
}

static void Batch_dealloc(BatchObject *b) {
    if (!b->finished && b->jobs) {
        Py_BEGIN_ALLOW_THREADS
        native_close(b);
        Py_END_ALLOW_THREADS
    }
    release_buffers(b); /* also the out of a Batch whose __init__ refused it */
    if (b->jobs) {
        pthread_mutex_destroy(&b->lock);
        pthread_cond_destroy(&b->more);
    }
    free(b->jobs), free(b->payloads), free(b->workers);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static int Batch_init(BatchObject *b, PyObject *args, PyObject *kwds) {
    static char *names[] = {"out", "out_h", "out_w", "capacity", "threads", NULL};
    if (b->jobs) {
        PyErr_SetString(PyExc_RuntimeError, "a Batch is made once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "w*iiii", names, &b->out, &b->out_h, &b->out_w, &b->capacity,
                                     &b->threads))
        return -1;
    b->have_out = 1;
    /* A refused __init__ lets go of what it took (the caller's buffer stays free, and a
     * second __init__ starts from nothing); `jobs` is set last: it means "made". */
    if (b->out_h <= 0 || b->out_w <= 0 || b->capacity <= 0 || b->threads <= 0 || b->threads > 256 ||
        !PyBuffer_IsContiguous(&b->out, 'C') ||
        (size_t)b->out.len < (size_t)b->capacity * 3 * (size_t)b->out_h * (size_t)b->out_w) {
        PyErr_SetString(PyExc_ValueError, "Batch: out must be a contiguous capacity x 3 x out_h x out_w buffer, threads 1..256");
        PyBuffer_Release(&b->out), b->have_out = 0;
        return -1;
    }
    native_job *jobs = calloc((size_t)b->capacity, sizeof(native_job));
    b->payloads = calloc((size_t)b->capacity, sizeof(Py_buffer));
    b->workers = calloc((size_t)b->threads, sizeof(pthread_t));
    if (!jobs || !b->payloads || !b->workers) {
        free(jobs), free(b->payloads), free(b->workers);
        b->payloads = NULL, b->workers = NULL;
        PyBuffer_Release(&b->out), b->have_out = 0;
        PyErr_NoMemory();
        return -1;
    }
    b->jobs = jobs;
    pthread_mutex_init(&b->lock, NULL);
    pthread_cond_init(&b->more, NULL);
    for (int t = 0; t < b->threads - 1; t++) {
        if (pthread_create(&b->workers[t], NULL, native_worker, b) != 0)
            break; /* fewer threads: the caller's thread makes the rest */
        b->started++;
    }
    return 0;
}

PyDoc_STRVAR(Batch_add_doc,
"add(k, payload, left, top, width, height, image_width, image_height, flip)\n\n"
"Queue image k of the batch: the JPEG ``payload`` (held until the batch is\n"
"finished), its crop box, the size its header claims, and whether to mirror it.\n"
"A thread of the batch may start on it before this returns.");

static PyObject *Batch_add(BatchObject *b, PyObject *args) {
    int k, left, top, width, height, image_w, image_h, flip;
    Py_buffer data;
    if (!b->jobs || b->finished || b->closed) {
        PyErr_SetString(PyExc_RuntimeError, "the batch is finished");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "iy*iiiiiip", &k, &data, &left, &top, &width, &height, &image_w, &image_h, &flip))
        return NULL;
    if (b->added >= b->capacity || k < 0 || k >= b->capacity || width <= 0 || height <= 0 || image_w <= 0 ||
        image_h <= 0 || left < 0 || top < 0 || (int64_t)left + width > image_w || (int64_t)top + height > image_h) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "Batch.add: a position outside the batch, or a box outside the image");
        return NULL;
    }
    native_job *j = &b->jobs[b->added];
    j->data = data.buf, j->len = data.len, j->k = k;
    j->left = left, j->top = top, j->width = width, j->height = height;
    j->image_w = image_w, j->image_h = image_h, j->flip = flip, j->failed = 0;
    b->payloads[b->added] = data;
    pthread_mutex_lock(&b->lock);
    b->added++;
    pthread_cond_signal(&b->more);
    pthread_mutex_unlock(&b->lock);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Batch_finish_doc,
"finish() -> list of (k, message)\n\n"
"Make every queued image (this thread joins the batch's threads, the GIL\n"
"released), and return the images that failed: a JPEG libjpeg warns about or\n"
"cannot decode, or a layout the region decoder does not take. Their slots hold\n"
"nothing defined: make them another way.");

static PyObject *Batch_finish(BatchObject *b, PyObject *unused) {
    if (!b->jobs) {
        PyErr_SetString(PyExc_RuntimeError, "the batch was not made");
        return NULL;
    }
    if (!b->finished) {
        Py_BEGIN_ALLOW_THREADS
        native_close(b);
        Py_END_ALLOW_THREADS
        release_buffers(b); /* the payloads (an LMDB map's pages) and the batch: free again */
    }
    PyObject *failed = PyList_New(0);
    for (int i = 0; failed && i < b->added; i++) {
        if (!b->jobs[i].failed)
            continue;
        PyObject *item = Py_BuildValue("(is)", b->jobs[i].k, b->jobs[i].error);
        if (!item || PyList_Append(failed, item) < 0)
            Py_CLEAR(failed);
        Py_XDECREF(item);
    }
    return failed;
}

static PyMethodDef Batch_methods[] = {
    {"add", (PyCFunction)Batch_add, METH_VARARGS, Batch_add_doc},
    {"finish", (PyCFunction)Batch_finish, METH_NOARGS, Batch_finish_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Batch_doc,
"Batch(out, out_h, out_w, capacity, threads)\n\n"
"Up to ``capacity`` JPEG crops decoded by region and resized (resize=\"native\")\n"
"into the planes of ``out`` (capacity x 3 x out_h x out_w uint8), by ``threads``\n"
"threads in all (this one included), none of them holding the GIL.");

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lmdbfolder.read._crops.Batch",
    .tp_basicsize = sizeof(BatchObject),
    .tp_dealloc = (destructor)Batch_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Batch_doc,
    .tp_methods = Batch_methods,
    .tp_init = (initproc)Batch_init,
    .tp_new = PyType_GenericNew,
};

PyDoc_STRVAR(resize_native_doc,
"resize_native(src, row_pixels, left, width, height, out_w, out_h, dst, flip[, window])\n\n"
"The resize of Batch alone: columns left .. left+width-1 of rows 0 .. height-1\n"
"of the RGB rows in ``src`` into the 3 x out_h x out_w planes of ``dst``,\n"
"mirrored when ``flip``. ``window`` = (x, y, w, h), in fractions of a pixel of\n"
"that box, is the part the output covers (default: all of it, (0, 0, width,\n"
"height)): a crop box scaled to an image decoded at a reduced DCT scale.");

static PyObject *native_simd(PyObject *self, PyObject *unused) { return PyBool_FromLong(simd_ok > 0); }

/* The widest vectors the exact resize's passes use here. */
static PyObject *exact_simd(PyObject *self, PyObject *unused) {
#ifdef EXACT_AVX2
    if (exact_vbmi)
        return PyUnicode_FromString("avx512-vbmi");
#endif
    return PyUnicode_FromString(exact_avx2 ? "avx2" : exact_sse41 ? "sse4.1" : "none");
}

static PyObject *resize_native(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    int row_pixels, left, width, height, out_w, out_h, flip;
    window win = {0.0, 0.0, -1.0, -1.0};
    if (!PyArg_ParseTuple(args, "y*iiiiiiw*p|(dddd)", &src, &row_pixels, &left, &width, &height, &out_w, &out_h, &dst,
                          &flip, &win.x, &win.y, &win.w, &win.h))
        return NULL;
    if (win.w < 0)
        win.w = width, win.h = height;
    const char *problem = NULL;
    if (width <= 0 || height <= 0 || out_w <= 0 || out_h <= 0 || left < 0 || row_pixels <= 0 ||
        (int64_t)left + width > row_pixels)
        problem = "the box is empty or outside the rows";
    else if (!(win.x >= 0 && win.y >= 0 && win.w > 0 && win.h > 0 && win.x + win.w <= width + 1e-6 &&
               win.y + win.h <= height + 1e-6))
        problem = "the window is empty or outside the box";
    else if ((size_t)src.len < (size_t)row_pixels * 3 * (size_t)height)
        problem = "src is smaller than height rows";
    else if ((size_t)dst.len < (size_t)out_w * (size_t)out_h * 3)
        problem = "dst is too small";
    int ok = 1;
    if (!problem) {
        native_scratch s;
        memset(&s, 0, sizeof(s));
        Py_BEGIN_ALLOW_THREADS
        ok = native_resize((const uint8_t *)src.buf + (size_t)left * 3, (const uint8_t *)src.buf + src.len,
                           (size_t)row_pixels * 3, width, height, out_w, out_h, flip, (uint8_t *)dst.buf, &s, win);
        Py_END_ALLOW_THREADS
        free(s.region), free(s.rows), free(s.xs);
    }
    PyBuffer_Release(&src), PyBuffer_Release(&dst);
    if (problem) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    if (!ok)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* PNG rows: undo the per-row filters (PNG spec section 9) of the inflated image
 * data of a non-interlaced PNG, for lmdbfolder.read.pairs.png_rows. Pillow
 * decodes a PNG into its 4-bytes-a-pixel storage, the whole width, then crops
 * and converts; here the rows a crop needs are unfiltered at their stored width
 * and the caller keeps the crop's columns only. Integer arithmetic on bytes, as
 * the spec defines it: the same bytes as any conforming decoder. */
static inline uint8_t paeth(int a, int b, int c) {
    int p = a + b - c, pa = abs(p - a), pb = abs(p - b), pc = abs(p - c);
    return (uint8_t)(pa <= pb && pa <= pc ? a : pb <= pc ? b : c);
}

/* Bytes from..from+count-1 of a row (its filter byte excluded), unfiltered into `row`. */
static void unfilter_span(int filter, uint8_t *row, const uint8_t *prev, size_t from, size_t count,
                          const uint8_t *raw, size_t b) {
    size_t end = from + count, i = from;
    switch (filter) {
    case 0:
        memcpy(row + from, raw, count);
        break;
    case 1:
        for (; i < end && i < b; i++)
            row[i] = raw[i - from];
        for (; i < end; i++)
            row[i] = (uint8_t)(raw[i - from] + row[i - b]);
        break;
    case 2:
        if (prev)
            for (; i < end; i++)
                row[i] = (uint8_t)(raw[i - from] + prev[i]);
        else
            memcpy(row + from, raw, count);
        break;
    case 3:
        for (; i < end && i < b; i++)
            row[i] = (uint8_t)(raw[i - from] + ((prev ? prev[i] : 0) >> 1));
        for (; i < end; i++)
            row[i] = (uint8_t)(raw[i - from] + ((row[i - b] + (prev ? prev[i] : 0)) >> 1));
        break;
    default: /* 4: Paeth */
        for (; i < end && i < b; i++)
            row[i] = (uint8_t)(raw[i - from] + (prev ? prev[i] : 0));
        if (prev)
            for (; i < end; i++)
                row[i] = (uint8_t)(raw[i - from] + paeth(row[i - b], prev[i], prev[i - b]));
        else
            for (; i < end; i++)
                row[i] = (uint8_t)(raw[i - from] + row[i - b]); /* Paeth of (a, 0, 0) is a */
    }
}

#ifdef EXACT_AVX2
/* gather's rows 64 outputs at a time: each block's columns lie within 128 bytes of the
 * block's first (the nearest indices of a shrink by under 2x, the usual crop), so one
 * vpermi2b takes the block from two 64-byte loads of the row. Returns 0 (having written
 * nothing) where some block's columns spread wider, or without memory. */
VBMI static int gather_vbmi(const uint8_t *src, Py_ssize_t stride, const int64_t *r, Py_ssize_t out_h, Py_ssize_t top,
                            const int64_t *c, Py_ssize_t out_w, Py_ssize_t left, int flip, uint8_t *out) {
    Py_ssize_t blocks = (out_w + 63) / 64;
    int64_t *base = malloc(sizeof(int64_t) * (size_t)blocks);
    uint8_t *idx = malloc((size_t)blocks * 64);
    if (!base || !idx) {
        free(base), free(idx);
        return 0;
    }
    for (Py_ssize_t b = 0; b < blocks; b++) {
        Py_ssize_t n = out_w - 64 * b < 64 ? out_w - 64 * b : 64;
        int64_t lo = INT64_MAX, hi = -1;
        for (Py_ssize_t j = 0; j < n; j++) {
            int64_t col = c[flip ? out_w - 1 - (64 * b + j) : 64 * b + j];
            lo = col < lo ? col : lo, hi = col > hi ? col : hi;
        }
        if (hi - lo >= 128) {
            free(base), free(idx);
            return 0;
        }
        base[b] = lo;
        memset(idx + 64 * b, 0, 64);
        for (Py_ssize_t j = 0; j < n; j++)
            idx[64 * b + j] = (uint8_t)(c[flip ? out_w - 1 - (64 * b + j) : 64 * b + j] - lo);
    }
    for (Py_ssize_t i = 0; i < out_h; i++) {
        const uint8_t *row = src + (top + r[i]) * stride + left;
        Py_ssize_t width = stride - left; /* bytes of the row from `row` on */
        for (Py_ssize_t b = 0; b < blocks; b++) {
            Py_ssize_t n = out_w - 64 * b < 64 ? out_w - 64 * b : 64, avail = width - base[b];
            __mmask64 m0 = avail >= 64 ? ~0ULL : (1ULL << avail) - 1;
            __mmask64 m1 = avail >= 128 ? ~0ULL : avail <= 64 ? 0 : (1ULL << (avail - 64)) - 1;
            const uint8_t *p = row + base[b];
            __m512i v = _mm512_permutex2var_epi8(_mm512_maskz_loadu_epi8(m0, p), _mm512_loadu_si512(idx + 64 * b),
                                                 _mm512_maskz_loadu_epi8(m1, p + 64));
            uint8_t *o = out + i * out_w + 64 * b;
            if (n == 64)
                _mm512_storeu_si512(o, v);
            else
                _mm512_mask_storeu_epi8(o, (1ULL << n) - 1, v);
        }
    }
    free(base), free(idx);
    return 1;
}
#endif

PyDoc_STRVAR(gather_doc,
"gather(src, stride, rows, top, cols, left, flip, dst)\n\n"
"The nearest resize of a mask's box as indices say: ``dst[i, j] = src[(top + rows[i]) * stride\n"
"+ left + cols[j]]`` (bytes; ``rows`` and ``cols``: int64 buffers; with ``flip`` the columns\n"
"are taken from the last). ``dst`` holds len(rows) * len(cols) bytes. What two numpy\n"
"``take``s give, in one pass. ValueError for an index outside ``src`` or buffers too small.");

static PyObject *gather(PyObject *self, PyObject *args) {
    Py_buffer src, rows, cols, dst;
    Py_ssize_t stride, top, left;
    int flip;
    if (!PyArg_ParseTuple(args, "y*ny*ny*npw*", &src, &stride, &rows, &top, &cols, &left, &flip, &dst))
        return NULL;
    const char *problem = NULL;
    Py_ssize_t out_h = rows.len / 8, out_w = cols.len / 8;
    const int64_t *r = (const int64_t *)rows.buf, *c = (const int64_t *)cols.buf;
    if (stride <= 0 || top < 0 || left < 0 || rows.len % 8 || cols.len % 8)
        problem = "stride, top, left or the index buffers are not what gather takes";
    else if (dst.len < out_h * out_w)
        problem = "dst is too small";
    /* Compared by subtraction and division: any int64 index is refused, none overflows. */
    for (Py_ssize_t i = 0; !problem && i < out_h; i++)
        if (r[i] < 0 || r[i] >= src.len / stride - top)
            problem = "a row index is outside src";
    for (Py_ssize_t j = 0; !problem && j < out_w; j++)
        if (c[j] < 0 || c[j] >= stride - left)
            problem = "a column index is outside a row";
    if (problem) {
        PyBuffer_Release(&src), PyBuffer_Release(&rows), PyBuffer_Release(&cols), PyBuffer_Release(&dst);
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    uint8_t *out = (uint8_t *)dst.buf;
#ifdef EXACT_AVX2
    if (exact_vbmi && gather_vbmi((const uint8_t *)src.buf, stride, r, out_h, top, c, out_w, left, flip, out))
        out_h = 0; /* done */
#endif
    for (Py_ssize_t i = 0; i < out_h; i++) {
        const uint8_t *row = (const uint8_t *)src.buf + (top + r[i]) * stride + left;
        uint8_t *o = out + i * out_w;
        if (flip)
            for (Py_ssize_t j = 0; j < out_w; j++)
                o[j] = row[c[out_w - 1 - j]];
        else
            for (Py_ssize_t j = 0; j < out_w; j++)
                o[j] = row[c[j]];
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src), PyBuffer_Release(&rows), PyBuffer_Release(&cols), PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(png_unfilter_stream_doc,
"png_unfilter_stream(src, at, filter, rows, stride, bpp, dst) -> filter\n\n"
"Undo the filters of the next piece ``src`` of a PNG's inflated image data (each\n"
"row: its filter byte, then ``stride`` bytes), which starts ``at`` bytes into that\n"
"data, into ``dst`` (``rows * stride`` bytes, writable; the rows before are there\n"
"already), ``bpp`` bytes a pixel. ``filter``: the filter type of the row ``at`` is\n"
"in (-1 when ``at`` starts a row). Returns the filter type of the row the piece\n"
"ends in, for the next call. Bytes past ``rows`` rows are ignored. ValueError on a\n"
"filter type that is not 0-4 or buffers too small. The pieces are what zlib gives,\n"
"so the rows a crop needs are never all held inflated at once.");

static PyObject *png_unfilter_stream(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    Py_ssize_t at, rows, stride, bpp;
    int filter;
    if (!PyArg_ParseTuple(args, "y*ninnnw*", &src, &at, &filter, &rows, &stride, &bpp, &dst))
        return NULL;
    const char *problem = NULL;
    if (at < 0 || rows < 0 || stride <= 0 || bpp <= 0 || bpp > 8 || bpp > stride || filter < -1 || filter > 4)
        problem = "at, filter, rows, stride or bpp out of range";
    else if (dst.len / stride < rows)
        problem = "dst is smaller than rows rows";
    int bad = 0;
    if (!problem) {
        Py_BEGIN_ALLOW_THREADS
        const uint8_t *in = (const uint8_t *)src.buf;
        uint8_t *out = (uint8_t *)dst.buf;
        size_t n = (size_t)src.len, i = 0, line = (size_t)stride + 1, pos = (size_t)at;
        while (i < n) {
            size_t y = pos / line, c = pos % line;
            if (y >= (size_t)rows)
                break;
            if (c == 0) {
                filter = in[i];
                if (filter > 4) {
                    bad = 1;
                    break;
                }
                i++, pos++;
                continue;
            }
            size_t m = line - c < n - i ? line - c : n - i;
            uint8_t *row = out + y * (size_t)stride;
            unfilter_span(filter, row, y ? row - stride : NULL, c - 1, m, in + i, (size_t)bpp);
            i += m, pos += m;
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src), PyBuffer_Release(&dst);
    if (problem || bad) {
        PyErr_SetString(PyExc_ValueError, problem ? problem : "a row has a filter type other than 0-4");
        return NULL;
    }
    return PyLong_FromLong(filter);
}

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS, decode_region_doc},
    {"resize_bilinear", resize_bilinear, METH_VARARGS, resize_bilinear_doc},
    {"resize_native", resize_native, METH_VARARGS, resize_native_doc},
    {"png_unfilter_stream", png_unfilter_stream, METH_VARARGS, png_unfilter_stream_doc},
    {"gather", gather, METH_VARARGS, gather_doc},
    {"exact_simd", exact_simd, METH_NOARGS,
     "The vectors the exact resize uses here: 'avx512-vbmi' (AVX-512 with VBMI and VNNI), 'avx2', "
     "'sse4.1' or 'none' (LMDBFOLDER_NO_AVX512 and LMDBFOLDER_NO_SIMD step down)."},
    {"native_simd", native_simd, METH_NOARGS, "Whether the native resize uses SSSE3 here (LMDBFOLDER_NO_SIMD unset)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_crops", "Partial JPEG decode for lmdbfolder.read.regions.", -1, methods,
};

PyMODINIT_FUNC PyInit__crops(void) {
#ifdef NATIVE_SIMD
    __builtin_cpu_init();
    simd_ok = __builtin_cpu_supports("ssse3") && getenv("LMDBFOLDER_NO_SIMD") == NULL;
#else
    simd_ok = 0;
#endif
#ifdef EXACT_SSE41
    __builtin_cpu_init();
    exact_sse41 = __builtin_cpu_supports("sse4.1") && getenv("LMDBFOLDER_NO_SIMD") == NULL;
    exact_avx2 = exact_sse41 && __builtin_cpu_supports("avx2");
    exact_vbmi = exact_avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi") &&
                 __builtin_cpu_supports("avx512vnni") &&
                 getenv("LMDBFOLDER_NO_AVX512") == NULL;
#endif
    if (PyType_Ready(&BatchType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&BatchType);
    if (PyModule_AddObject(m, "Batch", (PyObject *)&BatchType) < 0) {
        Py_DECREF(&BatchType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
