/*
 * Native fast path for the two loops on every Route: the chained block-key hash
 * (index/keys.py: chain_keys) and the match walk (index/_walk.py: match_walk_py).
 *
 * Both are exact re-implementations of the pure-Python functions, which stay the reference:
 * tests/test_native.py holds the two to identical results (keys, overlaps, their order, and
 * the path). In Python each of the ~250 iterations of a 4,000-token prompt costs a bytecode
 * loop turn, a call and an int allocation; here the hash is XXH3 inlined from the same
 * xxhash.h the `xxhash` package builds from (see _vendor/README.md), and the walk does one
 * dict lookup and one attribute read per block.
 *
 * The walk handles slot masks of up to 64 bits (64 worker slots) natively; wider masks
 * return NotImplemented and the caller falls back to Python, which has no width limit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

static PyObject *holders_name; /* interned "holders" */

/* chain_keys(data, block_size, seed, limit) -> list[int]
 *
 * key_i = XXH3_64bits_withSeed(data[i*bs*4 : (i+1)*bs*4], seed=key_{i-1}), key_-1 = seed,
 * over the full blocks of little-endian uint32 token ids in `data`; limit < 0 = no cap. */
static PyObject *
chain_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "chain_keys(data, block_size, seed, limit) takes 4 arguments");
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[1]);
    if (block_size == -1 && PyErr_Occurred())
        return NULL;
    if (block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be > 0");
        return NULL;
    }
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[2]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t limit = PyLong_AsSsize_t(args[3]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;

    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const Py_ssize_t step = block_size * 4;
    Py_ssize_t count = view.len / step;
    if (limit >= 0 && limit < count)
        count = limit;

    PyObject *keys = PyList_New(count);
    if (keys == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const char *data = (const char *)view.buf;
    XXH64_hash_t key = (XXH64_hash_t)seed;
    for (Py_ssize_t i = 0; i < count; i++) {
        key = XXH3_64bits_withSeed(data + i * step, (size_t)step, key);
        PyObject *item = PyLong_FromUnsignedLongLong(key);
        if (item == NULL) {
            Py_DECREF(keys);
            PyBuffer_Release(&view);
            return NULL;
        }
        PyList_SET_ITEM(keys, i, item);
    }
    PyBuffer_Release(&view);
    return keys;
}

/* Record overlaps[slot] = depth for every set bit of `bits`, lowest slot first. */
static int
set_overlaps(PyObject *overlaps, unsigned long long bits, Py_ssize_t depth)
{
    if (!bits)
        return 0;
    PyObject *value = PyLong_FromSsize_t(depth);
    if (value == NULL)
        return -1;
    while (bits) {
        int slot = __builtin_ctzll(bits);
        PyObject *k = PyLong_FromLong(slot);
        if (k == NULL || PyDict_SetItem(overlaps, k, value) < 0) {
            Py_XDECREF(k);
            Py_DECREF(value);
            return -1;
        }
        Py_DECREF(k);
        bits &= bits - 1;
    }
    Py_DECREF(value);
    return 0;
}

/* match_walk(blocks: dict, keys: sequence, slots_mask: int) -> (overlaps, path) | NotImplemented */
static PyObject *
match_walk(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "match_walk(blocks, keys, slots_mask) takes 3 arguments");
        return NULL;
    }
    PyObject *blocks = args[0];
    if (!PyDict_Check(blocks)) {
        PyErr_SetString(PyExc_TypeError, "blocks must be a dict");
        return NULL;
    }
    if (!PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "slots_mask must be an int");
        return NULL;
    }
    unsigned long long active = PyLong_AsUnsignedLongLong(args[2]);
    if (active == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return NULL;
        /* wider than 64 bits (or negative): Python's unbounded ints handle it */
        PyErr_Clear();
        Py_RETURN_NOTIMPLEMENTED;
    }

    PyObject *seq = PySequence_Fast(args[1], "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    PyObject *overlaps = PyDict_New();
    PyObject *path = PyList_New(0);
    if (overlaps == NULL || path == NULL)
        goto error;

    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t depth = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *node = PyDict_GetItemWithError(blocks, items[i]); /* borrowed */
        if (node == NULL) {
            if (PyErr_Occurred())
                goto error;
            break;
        }
        PyObject *holders_obj = PyObject_GetAttr(node, holders_name);
        if (holders_obj == NULL)
            goto error;
        /* only the low 64 bits can intersect `active` */
        unsigned long long holders = PyLong_AsUnsignedLongLongMask(holders_obj);
        Py_DECREF(holders_obj);
        if (holders == (unsigned long long)-1 && PyErr_Occurred())
            goto error;
        unsigned long long still = active & holders;
        if (still != active) {
            if (depth && set_overlaps(overlaps, active ^ still, depth) < 0)
                goto error;
            active = still;
            if (!active)
                break;
        }
        if (PyList_Append(path, node) < 0)
            goto error;
        depth++;
    }
    if (depth && set_overlaps(overlaps, active, depth) < 0)
        goto error;
    Py_DECREF(seq);
    PyObject *result = PyTuple_Pack(2, overlaps, path);
    Py_DECREF(overlaps);
    Py_DECREF(path);
    return result;

error:
    Py_DECREF(seq);
    Py_XDECREF(overlaps);
    Py_XDECREF(path);
    return NULL;
}

static PyMethodDef native_methods[] = {
    {"chain_keys", (PyCFunction)(void (*)(void))chain_keys, METH_FASTCALL,
     "chain_keys(data, block_size, seed, limit) -> list[int]: chained xxh3-64 keys of the full blocks."},
    {"match_walk", (PyCFunction)(void (*)(void))match_walk, METH_FASTCALL,
     "match_walk(blocks, keys, slots_mask) -> (overlaps, path), or NotImplemented for masks over 64 bits."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "kvrouterd.index._native",
    "Native fast path for block-key hashing and the match walk (see _native.c).", -1, native_methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    holders_name = PyUnicode_InternFromString("holders");
    if (holders_name == NULL)
        return NULL;
    return PyModule_Create(&native_module);
}
