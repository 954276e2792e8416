/* Philox4x32-10 blocks of a batch's samples, in one loop: the words keys.py draws in numpy.
 *
 * ``blocks(block, ids, k0, k1, out)``: for each i, the block of counter
 * (block[i], 0, ids[i] & 0xffffffff, ids[i] >> 32) under key (k0[i], k1[i]) (or k0[0], k1[0]
 * for every i when a key array holds one value), its four words written to out[4 i .. 4 i + 3].
 * All arguments are uint64 arrays; out holds uint32 values in uint64, as numpy's version.
 *
 * The state is kept in uint64 and each operation is numpy's (a product modulo 2**64, its high
 * half by a shift, xors, a mask), so the words are numpy's bit for bit for any input, not only
 * for counters below 2**32. Sizes are checked before the loop, which runs without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define M0 UINT64_C(0xD2511F53)
#define M1 UINT64_C(0xCD9E8D57)
#define W0 UINT64_C(0x9E3779B9)
#define W1 UINT64_C(0xBB67AE85)
#define LOW UINT64_C(0xFFFFFFFF)

static void philox_blocks(const uint64_t *block, const uint64_t *ids, const uint64_t *k0s,
                          const uint64_t *k1s, int per_sample_key, Py_ssize_t n, uint64_t *out)
{
    Py_ssize_t i;
    int r;
    for (i = 0; i < n; i++) {
        uint64_t x0 = block[i], x1 = 0, x2 = ids[i] & LOW, x3 = ids[i] >> 32;
        const uint64_t k0 = per_sample_key ? k0s[i] : k0s[0];
        const uint64_t k1 = per_sample_key ? k1s[i] : k1s[0];
        for (r = 0; r < 10; r++) {
            const uint64_t a = (k0 + (uint64_t)r * W0) & LOW, b = (k1 + (uint64_t)r * W1) & LOW;
            const uint64_t p0 = x0 * M0, p1 = x2 * M1;
            x0 = (p1 >> 32) ^ x1 ^ a;
            x1 = p1 & LOW;
            x2 = (p0 >> 32) ^ x3 ^ b;
            x3 = p0 & LOW;
        }
        out[4 * i] = x0;
        out[4 * i + 1] = x1;
        out[4 * i + 2] = x2;
        out[4 * i + 3] = x3;
    }
}

static PyObject *blocks(PyObject *self, PyObject *args)
{
    Py_buffer block, ids, k0, k1, out;
    const char *bad = NULL;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*:blocks", &block, &ids, &k0, &k1, &out)) return NULL;
    n = ids.len / 8;
    if (ids.len % 8 || block.len != ids.len)
        bad = "block and ids must be uint64 arrays of one size";
    else if (k0.len != k1.len || (k0.len != 8 && k0.len != ids.len))
        bad = "the keys must be one uint64 each, or one per sample";
    else if (out.len < 32 * n) bad = "out must hold four uint64 words a sample";
    if (bad == NULL) {
        const int per_sample_key = k0.len == ids.len && n != 1;
        Py_BEGIN_ALLOW_THREADS
        philox_blocks((const uint64_t *)block.buf, (const uint64_t *)ids.buf,
                      (const uint64_t *)k0.buf, (const uint64_t *)k1.buf, per_sample_key, n,
                      (uint64_t *)out.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&block);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&k0);
    PyBuffer_Release(&k1);
    PyBuffer_Release(&out);
    if (bad != NULL) {
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"blocks", blocks, METH_VARARGS,
     "blocks(block, ids, k0, k1, out): Philox4x32-10 words of each sample's block, without "
     "the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_philox", "Philox4x32-10 blocks of a batch, as keys.py draws them.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__philox(void) { return PyModule_Create(&module); }
