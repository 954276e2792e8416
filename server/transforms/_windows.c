/* Windows of a batch of 8-bit images through per-channel lookup tables, in one pass.
 *
 * ``gather(src, dst, oy, ox, flip, lut, geometry)`` writes, for every sample b, channel c and
 * output pixel (y, x):
 *
 *     dst[b, c, y, x] = lut[c, v]   where v = src[b, c, oy[b] - pad + y, sx] inside the image,
 *                                   sx = ox[b] - pad + (flip[b] ? w - 1 - x : x),
 *                                   and v = fill outside it (the padding).
 *
 * This is random_crop (pad, then a window), hflip (the window mirrored) and normalize (a
 * table of the 256 results of a uint8 input per channel, computed by numpy's own normalize,
 * so the values are numpy's bit for bit) done in a single pass, with no intermediate array.
 * Layouts are element strides, so CHW, HWC and HWC-to-CHW are the same loop. The table's
 * entries are 1, 2, 4 or 8 bytes and copied as such (float32 results are moved, not
 * recomputed). The loop runs without the GIL: other threads go on while a batch is made.
 *
 * Everything is checked before the loop: buffer sizes against the geometry, every stride
 * inside its sample, every offset inside the padded image. A bad call raises ValueError;
 * nothing is ever read or written out of bounds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    Py_ssize_t n, c, h_in, w_in;    /* batch, channels, input height and width */
    Py_ssize_t sc, sh, sw;          /* input element strides within a sample */
    Py_ssize_t h, w;                /* output height and width */
    Py_ssize_t dc, dh, dw;          /* output element strides within a sample */
    Py_ssize_t pad, fill, item;     /* padding, its uint8 value, bytes of a table entry */
} Geometry;

/* One output row: fill on [0, lo) and [hi, w), the image in between (mirrored if flip). */
#define ROW_KERNEL(NAME, T)                                                                    \
    static void NAME(const uint8_t *row, T *out, const T *table, const Geometry *g,            \
                     Py_ssize_t x0, int flip, int inside)                                      \
    {                                                                                          \
        const T pad_value = table[g->fill];                                                    \
        Py_ssize_t lo = 0, hi = 0, x;                                                          \
        if (inside) {                                                                          \
            lo = flip ? x0 + g->w - g->w_in : -x0;                                             \
            hi = flip ? x0 + g->w : g->w_in - x0;                                              \
            lo = lo < 0 ? 0 : (lo > g->w ? g->w : lo);                                         \
            hi = hi > g->w ? g->w : (hi < lo ? lo : hi);                                       \
        }                                                                                      \
        for (x = 0; x < lo; x++) out[x * g->dw] = pad_value;                                   \
        if (flip) {                                                                            \
            const Py_ssize_t last = x0 + g->w - 1;                                             \
            for (x = lo; x < hi; x++) out[x * g->dw] = table[row[(last - x) * g->sw]];         \
        } else if (g->sw == 1 && g->dw == 1) {                                                 \
            for (x = lo; x < hi; x++) out[x] = table[row[x0 + x]];                             \
        } else {                                                                               \
            for (x = lo; x < hi; x++) out[x * g->dw] = table[row[(x0 + x) * g->sw]];           \
        }                                                                                      \
        for (x = hi; x < g->w; x++) out[x * g->dw] = pad_value;                                \
    }

#define BATCH_KERNEL(NAME, ROW, T)                                                             \
    ROW_KERNEL(ROW, T)                                                                         \
    static void NAME(const uint8_t *src, void *dst_, const int64_t *oy, const int64_t *ox,     \
                     const uint8_t *flip, const void *lut_, const Geometry *g)                 \
    {                                                                                          \
        T *dst = (T *)dst_;                                                                    \
        const T *lut = (const T *)lut_;                                                        \
        const Py_ssize_t in_sample = g->c * g->h_in * g->w_in, out_sample = g->c * g->h * g->w; \
        Py_ssize_t b, c, y;                                                                    \
        for (b = 0; b < g->n; b++) {                                                           \
            const int f = flip != NULL && flip[b];                                             \
            const Py_ssize_t y0 = (Py_ssize_t)oy[b] - g->pad, x0 = (Py_ssize_t)ox[b] - g->pad; \
            for (c = 0; c < g->c; c++) {                                                       \
                const T *table = lut + c * 256;                                                \
                for (y = 0; y < g->h; y++) {                                                   \
                    const Py_ssize_t sy = y0 + y;                                              \
                    const int inside = sy >= 0 && sy < g->h_in;                                \
                    const uint8_t *row =                                                       \
                        src + b * in_sample + c * g->sc + (inside ? sy : 0) * g->sh;           \
                    T *out = dst + b * out_sample + c * g->dc + y * g->dh;                     \
                    ROW(row, out, table, g, x0, f, inside);                                    \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

BATCH_KERNEL(batch_1, row_1, uint8_t)
BATCH_KERNEL(batch_2, row_2, uint16_t)
BATCH_KERNEL(batch_4, row_4, uint32_t)
BATCH_KERNEL(batch_8, row_8, uint64_t)

/* Whether every element a c x h x w sample's strides reach lies inside its c * h * w. */
static int inside_sample(Py_ssize_t c, Py_ssize_t h, Py_ssize_t w, Py_ssize_t sc, Py_ssize_t sh,
                         Py_ssize_t sw)
{
    if (c < 0 || h < 0 || w < 0 || sc < 0 || sh < 0 || sw < 0) return 0;
    if (c == 0 || h == 0 || w == 0) return 1; /* no element is touched */
    return (c - 1) * sc + (h - 1) * sh + (w - 1) * sw < c * h * w;
}

static const char *check(const Geometry *g, Py_buffer *src, Py_buffer *dst, Py_buffer *oy,
                         Py_buffer *ox, Py_buffer *flip, Py_buffer *lut)
{
    Py_ssize_t b;
    if (g->n < 0) return "the batch size is negative";
    if (g->item != 1 && g->item != 2 && g->item != 4 && g->item != 8)
        return "a table entry must be 1, 2, 4 or 8 bytes";
    if (g->fill < 0 || g->fill > 255) return "fill must be a uint8 value";
    if (g->pad < 0) return "padding is negative";
    if (!inside_sample(g->c, g->h_in, g->w_in, g->sc, g->sh, g->sw))
        return "the input strides leave the sample";
    if (!inside_sample(g->c, g->h, g->w, g->dc, g->dh, g->dw))
        return "the output strides leave the sample";
    if (g->h > g->h_in + 2 * g->pad || g->w > g->w_in + 2 * g->pad)
        return "the window is larger than the padded image";
    if (src->len < g->n * g->c * g->h_in * g->w_in) return "the input is smaller than its shape";
    if (dst->len < g->n * g->c * g->h * g->w * g->item)
        return "the output is smaller than its shape";
    if (oy->len < g->n * 8 || ox->len < g->n * 8) return "fewer offsets than samples";
    if (flip->len != 0 && flip->len < g->n) return "fewer flips than samples";
    if (lut->len < g->c * 256 * g->item) return "the table holds fewer than 256 entries a channel";
    for (b = 0; b < g->n; b++) {
        const int64_t y = ((const int64_t *)oy->buf)[b], x = ((const int64_t *)ox->buf)[b];
        if (y < 0 || y > g->h_in + 2 * g->pad - g->h || x < 0 || x > g->w_in + 2 * g->pad - g->w)
            return "an offset is outside the padded image";
    }
    return NULL;
}

static PyObject *gather(PyObject *self, PyObject *args)
{
    Py_buffer src, dst, oy, ox, flip, lut;
    Geometry g;
    const char *bad;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*y*y*y*y*(nnnnnnnnnnnnnnn):gather", &src, &dst, &oy, &ox,
                          &flip, &lut, &g.n, &g.c, &g.h_in, &g.w_in, &g.sc, &g.sh, &g.sw, &g.h,
                          &g.w, &g.dc, &g.dh, &g.dw, &g.pad, &g.fill, &g.item))
        return NULL;
    bad = check(&g, &src, &dst, &oy, &ox, &flip, &lut);
    if (bad == NULL) {
        const uint8_t *f = flip.len ? (const uint8_t *)flip.buf : NULL;
        const int64_t *y = (const int64_t *)oy.buf, *x = (const int64_t *)ox.buf;
        Py_BEGIN_ALLOW_THREADS
        switch (g.item) {
        case 1: batch_1((const uint8_t *)src.buf, dst.buf, y, x, f, lut.buf, &g); break;
        case 2: batch_2((const uint8_t *)src.buf, dst.buf, y, x, f, lut.buf, &g); break;
        case 4: batch_4((const uint8_t *)src.buf, dst.buf, y, x, f, lut.buf, &g); break;
        default: batch_8((const uint8_t *)src.buf, dst.buf, y, x, f, lut.buf, &g); break;
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&oy);
    PyBuffer_Release(&ox);
    PyBuffer_Release(&flip);
    PyBuffer_Release(&lut);
    if (bad != NULL) {
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS,
     "gather(src, dst, oy, ox, flip, lut, geometry): windows of uint8 images through "
     "per-channel tables, in one pass without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_windows", "One-pass crop, flip and table lookup of uint8 images.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__windows(void) { return PyModule_Create(&module); }
