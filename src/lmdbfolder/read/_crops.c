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
    while (cinfo->output_scanline < end) {
        JDIMENSION at = cinfo->output_scanline;
        if (at < (JDIMENSION)top)
            return SHORT_READ;
        JSAMPROW row = (JSAMPROW)out->buf + (size_t)(at - (JDIMENSION)top) * stride;
        if (jpeg_read_scanlines(cinfo, &row, 1) != 1)
            return SHORT_READ; /* no progress (a suspending source): never loop on it */
    }
    if (!jpeg_has_multiple_scans(cinfo) &&
        !plain_entropy_data(cinfo->src->next_input_byte, cinfo->src->bytes_in_buffer, cinfo->unread_marker))
        return MARKER_BELOW; /* a progressive JPEG was read whole by jpeg_start_decompress */
    *x0 = x;
    *w0 = w;
    return DONE;
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
    struct jpeg_decompress_struct cinfo;
    error_mgr err;
    memset(&cinfo, 0, sizeof(cinfo)); /* jpeg_destroy of a never-created object is then a no-op */
    memset(&err, 0, sizeof(err));
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    volatile enum outcome result = DONE; /* volatile: set after a longjmp */
    JDIMENSION x0 = 0, w0 = 0;           /* read only when no longjmp happened */
    Py_BEGIN_ALLOW_THREADS
    if (setjmp(err.jump)) {
        result = LIBJPEG_ERROR;
    } else {
        jpeg_create_decompress(&cinfo);
        jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
        jpeg_read_header(&cinfo, TRUE);
        result = read_region(&cinfo, left, top, width, height, &out, expect_w, expect_h, &x0, &w0);
    }
    /* jpeg_destroy also aborts: the rows below the crop are never read. */
    jpeg_destroy_decompress(&cinfo);
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

/* Weights of output samples 0 .. out - 1 over input samples 0 .. in - 1:
 * first[o] and count[o] (the taps), weights[o * ksize + t]. Returns ksize or 0. */
static int bilinear_weights(int in, int out, int **first_p, int **count_p, int32_t **weights_p) {
    double scale = (double)(float)in / out; /* Pillow takes the box as floats */
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = 1.0 * filterscale;
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
            if (x < 0.0)
                x = -x;
            w[t] = x < 1.0 ? 1.0 - x : 0.0;
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

/* Rows 0 .. rows-1 of `in` resized horizontally (weights of `out_w` outputs). */
static void horizontal_pass(const uint8_t *in, size_t in_stride, int rows, int out_w, const int *first,
                            const int *count, const int32_t *w, int ksize, const target *t) {
    for (int y = 0; y < rows; y++) {
        const uint8_t *line = in + (size_t)y * in_stride;
        for (int x = 0; x < out_w; x++) {
            const int32_t *k = w + (size_t)x * ksize;
            const uint8_t *p = line + (size_t)first[x] * 3;
            int32_t r = 1 << (RESIZE_BITS - 1), g = r, b = r;
            for (int i = 0; i < count[x]; i++, p += 3) {
                r += p[0] * k[i];
                g += p[1] * k[i];
                b += p[2] * k[i];
            }
            store(t, y, x, clip8(r), clip8(g), clip8(b));
        }
    }
}

/* Columns 0 .. cols-1 of `in` resized vertically (weights of `out_h` outputs;
 * first[] counts rows of `in`). Row by row into `acc` (3 * cols int32), so the
 * inner loop runs along a row, which the compiler vectorises. */
static void vertical_pass(const uint8_t *in, size_t in_stride, int cols, int out_h, const int *first,
                          const int *count, const int32_t *w, int ksize, int32_t *acc, const target *t) {
    size_t n = (size_t)cols * 3;
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
        for (int x = 0; x < cols; x++)
            store(t, y, x, clip8(acc[3 * x]), clip8(acc[3 * x + 1]), clip8(acc[3 * x + 2]));
    }
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
"first when the height shrinks by more than twice what the width does (Pillow 13).");

static PyObject *resize_bilinear(PyObject *self, PyObject *args) {
    Py_buffer src, dst, tmp;
    int row_pixels, left, width, height, out_w, out_h, planar, flip, order;
    if (!PyArg_ParseTuple(args, "y*iiiiiiw*w*ppi", &src, &row_pixels, &left, &width, &height, &out_w, &out_h, &dst,
                          &tmp, &planar, &flip, &order))
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
        xk = bilinear_weights(width, out_w, &xfirst, &xcount, &xw);
        yk = bilinear_weights(height, out_h, &yfirst, &ycount, &yw);
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
            horizontal_pass(mid.buf, mid.stride, out_h, out_w, xfirst, xcount, xw, xk, &final);
    } else if (horizontal) {
        /* only the rows the vertical pass reads */
        int row0 = yfirst[0], row1 = yfirst[out_h - 1] + ycount[out_h - 1];
        target mid = {(uint8_t *)tmp.buf, (size_t)out_w * 3, out_w, 0, 0, 0};
        if (!vertical) {
            horizontal_pass(in, in_stride, height, out_w, xfirst, xcount, xw, xk, &final);
        } else {
            horizontal_pass(in + (size_t)row0 * in_stride, in_stride, row1 - row0, out_w, xfirst, xcount, xw, xk,
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

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS, decode_region_doc},
    {"resize_bilinear", resize_bilinear, METH_VARARGS, resize_bilinear_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_crops", "Partial JPEG decode for lmdbfolder.read.regions.", -1, methods,
};

PyMODINIT_FUNC PyInit__crops(void) { return PyModule_Create(&module); }
