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
 *
 * U64Map is the engine-hash -> key map of every event-driven worker (one entry per cached
 * block when the engine is vLLM or SGLang). A dict spends ~77 bytes per entry on it (the
 * entry, its share of the table, and an int object per engine hash); this open-addressing
 * table of two uint64 arrays spends ~24 (see _u64map_* below and index/native.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sys/mman.h>

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

/* ---- U64Map: uint64 -> uint64, linear probing, backward-shift deletion ------------------
 *
 * Any uint64 can be a key (engine hashes are arbitrary), so occupancy is a bitmap rather than
 * a reserved key value. Capacity is any size >= 8 (slots are chosen by multiply-shift, not a
 * power-of-two mask) and grows by half when the load would pass 0.8, so the load stays between
 * 0.53 and 0.8: 16.125 bytes per slot, about 24 per entry. Keys are mixed (murmur3's fmix64)
 * first: engine hashes are usually random, but sequential ones must not cluster either.
 */
typedef struct {
    PyObject_HEAD
    /* keys, values and the used bitmap live in one block: `table` */
    uint64_t *keys;
    uint64_t *values;
    uint64_t *used; /* bitmap over slots */
    Py_ssize_t capacity;
    Py_ssize_t size;
    void *table;
    size_t table_bytes;
} U64Map;

#define U64MAP_MIN_CAPACITY 8
/* Tables this large are mmap'ed: a freed one goes back to the OS at once. From the heap, the
 * tables a growing map leaves behind stayed resident (glibc raises its mmap threshold after the
 * first free), which doubled the map's RSS at 10^6 entries. */
#define U64MAP_MMAP_BYTES (1 << 20)

static void *
u64_table_alloc(size_t bytes)
{
    if (bytes < U64MAP_MMAP_BYTES)
        return PyMem_Calloc(1, bytes);
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p; /* zero-filled */
}

static void
u64_table_free(void *table, size_t bytes)
{
    if (table == NULL)
        return;
    if (bytes < U64MAP_MMAP_BYTES)
        PyMem_Free(table);
    else
        munmap(table, bytes);
}

static inline uint64_t
u64_mix(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static inline Py_ssize_t
u64_home(uint64_t key, Py_ssize_t capacity)
{
    return (Py_ssize_t)(((unsigned __int128)u64_mix(key) * (uint64_t)capacity) >> 64);
}

static inline int
u64_used(const U64Map *m, Py_ssize_t i)
{
    return (int)((m->used[i >> 6] >> (i & 63)) & 1);
}

static int
u64_alloc(U64Map *m, Py_ssize_t capacity)
{
    size_t words = ((size_t)capacity + 63) / 64;
    size_t bytes = ((size_t)capacity * 2 + words) * sizeof(uint64_t);
    uint64_t *table = u64_table_alloc(bytes);
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    m->table = table;
    m->table_bytes = bytes;
    m->keys = table;
    m->values = table + capacity;
    m->used = table + 2 * (size_t)capacity;
    m->capacity = capacity;
    m->size = 0;
    return 0;
}

/* slot of `key`, or -1 */
static Py_ssize_t
u64_find(const U64Map *m, uint64_t key)
{
    Py_ssize_t i = u64_home(key, m->capacity);
    while (u64_used(m, i)) {
        if (m->keys[i] == key)
            return i;
        if (++i == m->capacity)
            i = 0;
    }
    return -1;
}

/* insert or overwrite; the table must have a free slot */
static void
u64_put(U64Map *m, uint64_t key, uint64_t value)
{
    Py_ssize_t i = u64_home(key, m->capacity);
    while (u64_used(m, i)) {
        if (m->keys[i] == key) {
            m->values[i] = value;
            return;
        }
        if (++i == m->capacity)
            i = 0;
    }
    m->used[i >> 6] |= 1ULL << (i & 63);
    m->keys[i] = key;
    m->values[i] = value;
    m->size++;
}

static int
u64_resize(U64Map *m, Py_ssize_t capacity)
{
    U64Map old = *m;
    if (u64_alloc(m, capacity) < 0) {
        *m = old;
        return -1;
    }
    for (Py_ssize_t i = 0; i < old.capacity; i++)
        if (u64_used(&old, i))
            u64_put(m, old.keys[i], old.values[i]);
    u64_table_free(old.table, old.table_bytes);
    return 0;
}

/* remove the entry in slot i, shifting later members of its probe run back (no tombstones) */
static void
u64_erase(U64Map *m, Py_ssize_t i)
{
    Py_ssize_t cap = m->capacity;
    Py_ssize_t j = i;
    for (;;) {
        if (++j == cap)
            j = 0;
        if (!u64_used(m, j))
            break;
        Py_ssize_t home = u64_home(m->keys[j], cap);
        /* entry j may fill the hole at i unless its home lies cyclically in (i, j] */
        int home_in_range = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (home_in_range)
            continue;
        m->keys[i] = m->keys[j];
        m->values[i] = m->values[j];
        i = j;
    }
    m->used[i >> 6] &= ~(1ULL << (i & 63));
    m->size--;
}

static int
u64_key(PyObject *obj, uint64_t *out)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "U64Map keys and values are ints, not %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1; /* OverflowError: negative or >= 2**64 */
    *out = (uint64_t)v;
    return 0;
}

static PyObject *
U64Map_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "U64Map() takes no arguments");
        return NULL;
    }
    U64Map *m = (U64Map *)type->tp_alloc(type, 0);
    if (m == NULL)
        return NULL;
    if (u64_alloc(m, U64MAP_MIN_CAPACITY) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

static void
U64Map_dealloc(U64Map *m)
{
    u64_table_free(m->table, m->table_bytes);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t
U64Map_len(U64Map *m)
{
    return m->size;
}

static PyObject *
U64Map_subscript(U64Map *m, PyObject *keyobj)
{
    uint64_t key;
    if (u64_key(keyobj, &key) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return NULL;
        PyErr_Clear(); /* out of range: cannot be present */
    }
    else {
        Py_ssize_t i = u64_find(m, key);
        if (i >= 0)
            return PyLong_FromUnsignedLongLong(m->values[i]);
    }
    PyErr_SetObject(PyExc_KeyError, keyobj);
    return NULL;
}

static int
U64Map_ass_subscript(U64Map *m, PyObject *keyobj, PyObject *valueobj)
{
    uint64_t key, value;
    if (u64_key(keyobj, &key) < 0)
        return -1;
    if (valueobj == NULL) {
        Py_ssize_t i = u64_find(m, key);
        if (i < 0) {
            PyErr_SetObject(PyExc_KeyError, keyobj);
            return -1;
        }
        u64_erase(m, i);
        return 0;
    }
    if (u64_key(valueobj, &value) < 0)
        return -1;
    if ((m->size + 1) * 5 > m->capacity * 4 && u64_find(m, key) < 0) {
        if (u64_resize(m, m->capacity + m->capacity / 2) < 0)
            return -1;
    }
    u64_put(m, key, value);
    return 0;
}

static int
U64Map_contains(U64Map *m, PyObject *keyobj)
{
    uint64_t key;
    if (u64_key(keyobj, &key) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    return u64_find(m, key) >= 0;
}

/* get(key, default=None) */
static PyObject *
U64Map_get(U64Map *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    int found = U64Map_contains(m, args[0]);
    if (found < 0)
        return NULL;
    if (found)
        return PyLong_FromUnsignedLongLong(m->values[u64_find(m, PyLong_AsUnsignedLongLong(args[0]))]);
    PyObject *dflt = nargs == 2 ? args[1] : Py_None;
    return Py_NewRef(dflt);
}

/* pop(key[, default]) */
static PyObject *
U64Map_pop(U64Map *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    int found = U64Map_contains(m, args[0]);
    if (found < 0)
        return NULL;
    if (found) {
        Py_ssize_t i = u64_find(m, PyLong_AsUnsignedLongLong(args[0]));
        PyObject *value = PyLong_FromUnsignedLongLong(m->values[i]);
        if (value != NULL)
            u64_erase(m, i);
        return value;
    }
    if (nargs == 2)
        return Py_NewRef(args[1]);
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyObject *
U64Map_clear(U64Map *m, PyObject *unused)
{
    void *table = m->table;
    size_t bytes = m->table_bytes;
    if (u64_alloc(m, U64MAP_MIN_CAPACITY) < 0)
        return NULL;
    u64_table_free(table, bytes);
    Py_RETURN_NONE;
}

/* a list of keys (which = 0), values (1) or (key, value) tuples (2), in slot order */
static PyObject *
u64_list(U64Map *m, int which)
{
    PyObject *out = PyList_New(m->size);
    if (out == NULL)
        return NULL;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < m->capacity; i++) {
        if (!u64_used(m, i))
            continue;
        PyObject *item;
        if (which == 2)
            item = Py_BuildValue("(KK)", (unsigned long long)m->keys[i], (unsigned long long)m->values[i]);
        else
            item = PyLong_FromUnsignedLongLong(which ? m->values[i] : m->keys[i]);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, n++, item);
    }
    return out;
}

static PyObject *U64Map_keys(U64Map *m, PyObject *unused) { return u64_list(m, 0); }
static PyObject *U64Map_values(U64Map *m, PyObject *unused) { return u64_list(m, 1); }
static PyObject *U64Map_items(U64Map *m, PyObject *unused) { return u64_list(m, 2); }

static PyObject *
U64Map_iter(U64Map *m)
{
    PyObject *keys = u64_list(m, 0);
    if (keys == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *
U64Map_sizeof(U64Map *m, PyObject *unused)
{
    return PyLong_FromSize_t(sizeof(U64Map) + m->table_bytes);
}

static PyMethodDef U64Map_methods[] = {
    {"get", (PyCFunction)(void (*)(void))U64Map_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))U64Map_pop, METH_FASTCALL, "pop(key[, default])"},
    {"clear", (PyCFunction)U64Map_clear, METH_NOARGS, "remove every entry and release the table"},
    {"keys", (PyCFunction)U64Map_keys, METH_NOARGS, "a list of the keys"},
    {"values", (PyCFunction)U64Map_values, METH_NOARGS, "a list of the values"},
    {"items", (PyCFunction)U64Map_items, METH_NOARGS, "a list of (key, value) pairs"},
    {"__sizeof__", (PyCFunction)U64Map_sizeof, METH_NOARGS, "bytes used, tables included"},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods U64Map_as_mapping = {
    (lenfunc)U64Map_len, (binaryfunc)U64Map_subscript, (objobjargproc)U64Map_ass_subscript,
};

static PySequenceMethods U64Map_as_sequence = {
    .sq_contains = (objobjproc)U64Map_contains,
};

static PyTypeObject U64MapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvrouterd.index._native.U64Map",
    .tp_doc = "A compact dict of uint64 -> uint64 (keys and values 0 <= x < 2**64).",
    .tp_basicsize = sizeof(U64Map),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = U64Map_new,
    .tp_dealloc = (destructor)U64Map_dealloc,
    .tp_as_mapping = &U64Map_as_mapping,
    .tp_as_sequence = &U64Map_as_sequence,
    .tp_iter = (getiterfunc)U64Map_iter,
    .tp_methods = U64Map_methods,
};

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
    if (holders_name == NULL || PyType_Ready(&U64MapType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "U64Map", (PyObject *)&U64MapType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
