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
#include <setjmp.h>
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

enum outcome { DONE, LIBJPEG_ERROR, UNTESTED_SAMPLING, MARKER_BELOW, BOX_OUTSIDE, OUT_TOO_SMALL };

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
                                JDIMENSION *x0, JDIMENSION *w0) {
    if (!tested_sampling(cinfo))
        return UNTESTED_SAMPLING;
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
    JDIMENSION end = (JDIMENSION)top + (JDIMENSION)height;
    while (cinfo->output_scanline < end) {
        JSAMPROW row = (JSAMPROW)out->buf + (size_t)(cinfo->output_scanline - (JDIMENSION)top) * stride;
        jpeg_read_scanlines(cinfo, &row, 1);
    }
    if (!jpeg_has_multiple_scans(cinfo) &&
        !plain_entropy_data(cinfo->src->next_input_byte, cinfo->src->bytes_in_buffer, cinfo->unread_marker))
        return MARKER_BELOW; /* a progressive JPEG was read whole by jpeg_start_decompress */
    *x0 = x;
    *w0 = w;
    return DONE;
}

PyDoc_STRVAR(decode_region_doc,
"decode_region(data, left, top, width, height, out) -> (x0, w0)\n\n"
"Decode rows top .. top+height-1 of the JPEG ``data`` as RGB into the writable\n"
"buffer ``out``, columns x0 .. x0+w0-1 of each (row stride 3*w0), with\n"
"x0 < left when left > 0 and x0 + w0 >= left + width. The caller's box starts\n"
"at column left - x0 of each row. Raises ValueError for a JPEG libjpeg cannot\n"
"decode or warns about, one with a stray marker after the crop's rows, an\n"
"untested chroma layout, a box outside the image, or an ``out`` that is too\n"
"small (3 * image width * height bytes always suffice).");

static PyObject *decode_region(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    int left, top, width, height;
    if (!PyArg_ParseTuple(args, "y*iiiiw*", &data, &left, &top, &width, &height, &out))
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
        result = read_region(&cinfo, left, top, width, height, &out, &x0, &w0);
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
    default:
        break;
    }
    if (err.warned) {
        PyErr_Format(PyExc_ValueError, "libjpeg warned: %s", err.message);
        return NULL;
    }
    return Py_BuildValue("II", (unsigned int)x0, (unsigned int)w0);
}

PyDoc_STRVAR(libjpeg_version_doc, "libjpeg_version() -> int: JPEG_LIB_VERSION this module was built against.");

static PyObject *libjpeg_version(PyObject *self, PyObject *args) { return PyLong_FromLong(JPEG_LIB_VERSION); }

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS, decode_region_doc},
    {"libjpeg_version", libjpeg_version, METH_NOARGS, libjpeg_version_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpegregion", "Partial JPEG decode for lmdbfolder.read.regions.", -1, methods,
};

PyMODINIT_FUNC PyInit__jpegregion(void) { return PyModule_Create(&module); }
