/*
 * Native fast path for the two loops on every Route: the chained block-key hash
 * (index/keys.py: chain_keys) and the match walk (index/_walk.py: match_walk_py).
 *
 * Both are exact re-implementations of the pure-Python functions, which stay the reference:
 * tests/unit/index/test_native.py holds the two to identical results (keys, overlaps, their order, and
 * the path). In Python each of the ~250 iterations of a 4,000-token prompt costs a bytecode
 * loop turn, a call and an int allocation; here the hash is XXH3 inlined from the same
 * xxhash.h the `xxhash` package builds from (see _vendor/README.md), and the walk reads the
 * index's BlockTable (below) directly, prefetching ahead of itself.
 *
 * The walk handles slot masks of up to 64 bits (64 worker slots) natively; wider masks
 * return NotImplemented and the caller falls back to Python, which has no width limit.
 *
 * Two compact uint64-keyed tables replace dicts that hold one entry per cached block: U64Map,
 * the engine-hash -> key map of every event-driven worker (vLLM, SGLang), and BlockTable,
 * RadixIndex's key -> Block map. A dict spends ~41 bytes per entry plus an int object per key;
 * these spend ~24, and the match walk reads a BlockTable directly, prefetching ahead of itself.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>
#include <sys/mman.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

static PyObject *holders_name; /* interned "holders" */

/* Arguments of chain_keys/chain_keys_packed: (data, block_size, seed, limit). On success the
 * caller owns `view` and must release it. */
static int
chain_args(PyObject *const *args, Py_ssize_t nargs, Py_buffer *view, Py_ssize_t *step, Py_ssize_t *count,
           uint64_t *seed)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "takes 4 arguments: (data, block_size, seed, limit)");
        return -1;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[1]);
    if (block_size == -1 && PyErr_Occurred())
        return -1;
    if (block_size <= 0 || block_size > PY_SSIZE_T_MAX / 4) {
        PyErr_SetString(PyExc_ValueError, "block_size must be > 0 (and fit a byte count)");
        return -1;
    }
    unsigned long long s = PyLong_AsUnsignedLongLong(args[2]);
    if (s == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    Py_ssize_t limit = PyLong_AsSsize_t(args[3]);
    if (limit == -1 && PyErr_Occurred())
        return -1;
    if (PyObject_GetBuffer(args[0], view, PyBUF_SIMPLE) < 0)
        return -1;
    *step = block_size * 4;
    *count = view->len / *step;
    if (limit >= 0 && limit < *count)
        *count = limit;
    *seed = (uint64_t)s;
    return 0;
}

/* key_i = XXH3_64bits_withSeed(block i, seed=key_{i-1}), key_-1 = seed */
static void
chain_into(const char *data, Py_ssize_t step, Py_ssize_t count, uint64_t seed, uint64_t *out)
{
    XXH64_hash_t key = (XXH64_hash_t)seed;
    for (Py_ssize_t i = 0; i < count; i++) {
        key = XXH3_64bits_withSeed(data + i * step, (size_t)step, key);
        out[i] = key;
    }
}

/* chain_keys(data, block_size, seed, limit) -> list[int]
 *
 * The keys of the full blocks of little-endian uint32 token ids in `data`; limit < 0 = all. */
static PyObject *
chain_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    Py_ssize_t step, count;
    uint64_t seed;
    if (chain_args(args, nargs, &view, &step, &count, &seed) < 0)
        return NULL;
    uint64_t *raw = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(uint64_t));
    if (raw == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    chain_into((const char *)view.buf, step, count, seed, raw);
    PyBuffer_Release(&view);
    PyObject *keys = PyList_New(count);
    for (Py_ssize_t i = 0; keys != NULL && i < count; i++) {
        PyObject *item = PyLong_FromUnsignedLongLong(raw[i]);
        if (item == NULL)
            Py_CLEAR(keys);
        else
            PyList_SET_ITEM(keys, i, item);
    }
    PyMem_Free(raw);
    return keys;
}

/* chain_keys_packed(data, block_size, seed, limit) -> bytes: the same keys as native-endian
 * uint64s (for array('Q').frombytes). No int object per key, which is most of what hashing a
 * prompt costs once the hash itself is native. */
static PyObject *
chain_keys_packed(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    Py_ssize_t step, count;
    uint64_t seed;
    if (chain_args(args, nargs, &view, &step, &count, &seed) < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(uint64_t));
    if (out != NULL)
        chain_into((const char *)view.buf, step, count, seed, (uint64_t *)PyBytes_AS_STRING(out));
    PyBuffer_Release(&view);
    return out;
}

/* ---- open-addressing uint64-keyed tables -------------------------------------------------
 *
 * One table core serves U64Map (uint64 -> uint64: the engine-hash -> key map) and BlockTable
 * (uint64 -> object: RadixIndex's key -> Block map). Entries are (key, value) pairs in one
 * array, so a lookup touches one cache line; linear probing, backward-shift deletion (no
 * tombstones). Any uint64 can be a key, so occupancy is a bitmap rather than a reserved key.
 * Capacity is any size >= 8 (slots are chosen by multiply-shift, not a power-of-two mask) and
 * grows by half when the load would pass 0.8, so the load stays between 0.53 and 0.8: 16.125
 * bytes per slot, about 24 per entry, where a dict spends ~41 per entry plus an int object
 * per key. Keys are mixed (murmur3's fmix64) first: sequential keys must not cluster.
 */
typedef struct {
    PyObject_HEAD
    uint64_t *entries; /* capacity (key, value) pairs */
    uint64_t *used;    /* bitmap over slots */
    Py_ssize_t capacity;
    Py_ssize_t size;
    void *table; /* entries and used, one allocation */
    size_t table_bytes;
    int owns_values; /* BlockTable: values are owned PyObject* */
} U64Table;

#define T_KEY(t, i) ((t)->entries[2 * (size_t)(i)])
#define T_VAL(t, i) ((t)->entries[2 * (size_t)(i) + 1])
#define T_OBJ(t, i) ((PyObject *)(uintptr_t)T_VAL(t, i))

#define TABLE_MIN_CAPACITY 8
/* Tables this large are mmap'ed: a freed one goes back to the OS at once. From the heap, the
 * tables a growing map leaves behind stayed resident (glibc raises its mmap threshold after the
 * first free), which doubled a map's RSS at 10^6 entries. */
#define TABLE_MMAP_BYTES (1 << 20)

static void *
table_alloc(size_t bytes)
{
    if (bytes < TABLE_MMAP_BYTES)
        return PyMem_Calloc(1, bytes);
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p; /* zero-filled */
}

static void
table_free(void *table, size_t bytes)
{
    if (table == NULL)
        return;
    if (bytes < TABLE_MMAP_BYTES)
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
t_home(uint64_t key, Py_ssize_t capacity)
{
    return (Py_ssize_t)(((unsigned __int128)u64_mix(key) * (uint64_t)capacity) >> 64);
}

static inline int
t_used(const U64Table *t, Py_ssize_t i)
{
    return (int)((t->used[i >> 6] >> (i & 63)) & 1);
}

static int
t_alloc(U64Table *t, Py_ssize_t capacity)
{
    size_t words = ((size_t)capacity + 63) / 64;
    size_t bytes = ((size_t)capacity * 2 + words) * sizeof(uint64_t);
    uint64_t *table = table_alloc(bytes);
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->table = table;
    t->table_bytes = bytes;
    t->entries = table;
    t->used = table + 2 * (size_t)capacity;
    t->capacity = capacity;
    t->size = 0;
    return 0;
}

/* slot of `key`, or -1 */
static inline Py_ssize_t
t_find(const U64Table *t, uint64_t key)
{
    Py_ssize_t i = t_home(key, t->capacity);
    while (t_used(t, i)) {
        if (T_KEY(t, i) == key)
            return i;
        if (++i == t->capacity)
            i = 0;
    }
    return -1;
}

/* put `key` (known absent) into a free slot; the table must have one */
static void
t_insert(U64Table *t, uint64_t key, uint64_t value)
{
    Py_ssize_t i = t_home(key, t->capacity);
    while (t_used(t, i)) {
        if (++i == t->capacity)
            i = 0;
    }
    t->used[i >> 6] |= 1ULL << (i & 63);
    T_KEY(t, i) = key;
    T_VAL(t, i) = value;
    t->size++;
}

static int
t_resize(U64Table *t, Py_ssize_t capacity)
{
    U64Table old = *t;
    if (t_alloc(t, capacity) < 0) {
        *t = old;
        return -1;
    }
    for (Py_ssize_t i = 0; i < old.capacity; i++)
        if (t_used(&old, i))
            t_insert(t, T_KEY(&old, i), T_VAL(&old, i)); /* references move with the values */
    table_free(old.table, old.table_bytes);
    return 0;
}

/* room for one more entry (grows by half past load 0.8) */
static int
t_reserve_one(U64Table *t)
{
    if ((t->size + 1) * 5 > t->capacity * 4)
        return t_resize(t, t->capacity + t->capacity / 2);
    return 0;
}

/* remove the entry in slot i, shifting later members of its probe run back (no tombstones);
 * returns the removed value (an owned reference for BlockTable: the caller releases it) */
static uint64_t
t_erase(U64Table *t, Py_ssize_t i)
{
    uint64_t removed = T_VAL(t, i);
    Py_ssize_t cap = t->capacity;
    Py_ssize_t j = i;
    for (;;) {
        if (++j == cap)
            j = 0;
        if (!t_used(t, j))
            break;
        Py_ssize_t home = t_home(T_KEY(t, j), cap);
        /* entry j may fill the hole at i unless its home lies cyclically in (i, j] */
        int home_in_range = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (home_in_range)
            continue;
        T_KEY(t, i) = T_KEY(t, j);
        T_VAL(t, i) = T_VAL(t, j);
        i = j;
    }
    t->used[i >> 6] &= ~(1ULL << (i & 63));
    t->size--;
    return removed;
}

/* 0 and *out set; 1 if `obj` is an int outside [0, 2**64) (so never a key); -1 on error */
static int
t_key(PyObject *obj, uint64_t *out)
{
    if (!PyLong_Check(obj)) {
        /* integer-like keys (numpy's uint64 scalars) hash and compare as ints in a dict */
        if (!PyIndex_Check(obj)) {
            PyErr_Format(PyExc_TypeError, "keys are ints, not %.100s", Py_TYPE(obj)->tp_name);
            return -1;
        }
        PyObject *as_int = PyNumber_Index(obj);
        if (as_int == NULL)
            return -1;
        int r = t_key(as_int, out);
        Py_DECREF(as_int);
        return r;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        return 1;
    }
    *out = (uint64_t)v;
    return 0;
}

/* a strict key: outside [0, 2**64) raises OverflowError */
static int
t_key_strict(PyObject *obj, uint64_t *out)
{
    int r = t_key(obj, out);
    if (r == 1)
        PyErr_SetString(PyExc_OverflowError, "keys are between 0 and 2**64 - 1");
    return r == 0 ? 0 : -1;
}

static PyObject *
t_value_object(const U64Table *t, Py_ssize_t i)
{
    if (t->owns_values)
        return Py_NewRef(T_OBJ(t, i));
    return PyLong_FromUnsignedLongLong(T_VAL(t, i));
}

static void blocks_unlink(U64Table *t);

/* release every value and reset to an empty minimum-size table */
static int
t_reset(U64Table *t)
{
    U64Table old = *t;
    if (t_alloc(t, TABLE_MIN_CAPACITY) < 0)
        return -1;
    if (old.owns_values) {
        blocks_unlink(&old);
        for (Py_ssize_t i = 0; i < old.capacity; i++)
            if (t_used(&old, i))
                Py_DECREF(T_OBJ(&old, i));
    }
    table_free(old.table, old.table_bytes);
    return 0;
}

static PyObject *
Table_new_impl(PyTypeObject *type, PyObject *args, PyObject *kwds, int owns_values)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_Format(PyExc_TypeError, "%.100s() takes no arguments", type->tp_name);
        return NULL;
    }
    U64Table *t = (U64Table *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->owns_values = owns_values;
    if (t_alloc(t, TABLE_MIN_CAPACITY) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static PyObject *U64Map_new(PyTypeObject *type, PyObject *args, PyObject *kwds) { return Table_new_impl(type, args, kwds, 0); }
static PyObject *BlockTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds) { return Table_new_impl(type, args, kwds, 1); }

static void
U64Map_dealloc(U64Table *t)
{
    table_free(t->table, t->table_bytes);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int
BlockTable_traverse(U64Table *t, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < t->capacity; i++)
        if (t_used(t, i))
            Py_VISIT(T_OBJ(t, i));
    return 0;
}

static int
BlockTable_clear_refs(U64Table *t)
{
    return t->table == NULL ? 0 : t_reset(t);
}

static void
BlockTable_dealloc(U64Table *t)
{
    PyObject_GC_UnTrack(t);
    Py_TRASHCAN_BEGIN(t, BlockTable_dealloc)
    if (t->table != NULL) {
        blocks_unlink(t);
        for (Py_ssize_t i = 0; i < t->capacity; i++)
            if (t_used(t, i))
                Py_DECREF(T_OBJ(t, i));
        table_free(t->table, t->table_bytes);
        t->table = NULL;
    }
    Py_TYPE(t)->tp_free((PyObject *)t);
    Py_TRASHCAN_END
}

static Py_ssize_t
Table_len(U64Table *t)
{
    return t->size;
}

static PyObject *
Table_subscript(U64Table *t, PyObject *keyobj)
{
    uint64_t key;
    int r = t_key(keyobj, &key);
    if (r < 0)
        return NULL;
    if (r == 0) {
        Py_ssize_t i = t_find(t, key);
        if (i >= 0)
            return t_value_object(t, i);
    }
    PyErr_SetObject(PyExc_KeyError, keyobj);
    return NULL;
}

static int
Table_ass_subscript(U64Table *t, PyObject *keyobj, PyObject *valueobj)
{
    uint64_t key;
    if (valueobj == NULL) {
        int r = t_key(keyobj, &key);
        if (r < 0)
            return -1;
        Py_ssize_t i = r == 0 ? t_find(t, key) : -1;
        if (i < 0) {
            PyErr_SetObject(PyExc_KeyError, keyobj);
            return -1;
        }
        uint64_t removed = t_erase(t, i);
        if (t->owns_values)
            Py_DECREF((PyObject *)(uintptr_t)removed);
        return 0;
    }
    if (t_key_strict(keyobj, &key) < 0)
        return -1;
    uint64_t value;
    if (t->owns_values)
        value = (uint64_t)(uintptr_t)valueobj;
    else if (t_key_strict(valueobj, &value) < 0)
        return -1;
    Py_ssize_t i = t_find(t, key);
    if (i >= 0) {
        uint64_t old = T_VAL(t, i);
        if (t->owns_values)
            Py_INCREF(valueobj);
        T_VAL(t, i) = value;
        if (t->owns_values)
            Py_DECREF((PyObject *)(uintptr_t)old);
        return 0;
    }
    if (t_reserve_one(t) < 0)
        return -1;
    if (t->owns_values)
        Py_INCREF(valueobj);
    t_insert(t, key, value);
    return 0;
}

/* slot of `keyobj`, -1 if absent (or not a possible key), -2 on error */
static Py_ssize_t
t_lookup(U64Table *t, PyObject *keyobj)
{
    uint64_t key;
    int r = t_key(keyobj, &key);
    if (r < 0)
        return -2;
    return r == 0 ? t_find(t, key) : -1;
}

static int
Table_contains(U64Table *t, PyObject *keyobj)
{
    Py_ssize_t i = t_lookup(t, keyobj);
    return i == -2 ? -1 : i >= 0;
}

/* get(key, default=None) */
static PyObject *
Table_get(U64Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    Py_ssize_t i = t_lookup(t, args[0]);
    if (i == -2)
        return NULL;
    if (i >= 0)
        return t_value_object(t, i);
    return Py_NewRef(nargs == 2 ? args[1] : Py_None);
}

/* pop(key[, default]) */
static PyObject *
Table_pop(U64Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    Py_ssize_t i = t_lookup(t, args[0]);
    if (i == -2)
        return NULL;
    if (i >= 0) {
        if (t->owns_values)
            return (PyObject *)(uintptr_t)t_erase(t, i); /* the table's reference passes to the caller */
        PyObject *value = PyLong_FromUnsignedLongLong(T_VAL(t, i));
        if (value != NULL)
            t_erase(t, i);
        return value;
    }
    if (nargs == 2)
        return Py_NewRef(args[1]);
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyObject *
Table_clear(U64Table *t, PyObject *unused)
{
    if (t_reset(t) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* a list of keys (which = 0), values (1) or (key, value) tuples (2), in slot order */
static PyObject *
t_list(U64Table *t, int which)
{
    /* Snapshot the entries first (owning the object values): building the Python objects
     * allocates, and a collection's finalizers could change the table meanwhile. */
    Py_ssize_t size = t->size;
    uint64_t *snap = PyMem_Malloc((size_t)(size ? size : 1) * 2 * sizeof(uint64_t));
    if (snap == NULL)
        return PyErr_NoMemory();
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < t->capacity && n < size; i++) {
        if (!t_used(t, i))
            continue;
        snap[2 * n] = T_KEY(t, i);
        snap[2 * n + 1] = T_VAL(t, i);
        if (t->owns_values)
            Py_INCREF(T_OBJ(t, i));
        n++;
    }
    int owns = t->owns_values;
    PyObject *out = PyList_New(n);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *item = NULL;
        if (out != NULL) {
            PyObject *key = which == 1 ? NULL : PyLong_FromUnsignedLongLong(snap[2 * k]);
            PyObject *value = NULL;
            if (which != 0)
                value = owns ? Py_NewRef((PyObject *)(uintptr_t)snap[2 * k + 1])
                             : PyLong_FromUnsignedLongLong(snap[2 * k + 1]);
            if (which == 0)
                item = Py_XNewRef(key);
            else if (which == 1)
                item = Py_XNewRef(value);
            else if (key != NULL && value != NULL)
                item = PyTuple_Pack(2, key, value);
            Py_XDECREF(key);
            Py_XDECREF(value);
            if (item == NULL)
                Py_CLEAR(out);
            else
                PyList_SET_ITEM(out, k, item);
        }
        if (owns)
            Py_DECREF((PyObject *)(uintptr_t)snap[2 * k + 1]);
    }
    PyMem_Free(snap);
    return out;
}

static PyObject *Table_keys(U64Table *t, PyObject *unused) { return t_list(t, 0); }
static PyObject *Table_values(U64Table *t, PyObject *unused) { return t_list(t, 1); }
static PyObject *Table_items(U64Table *t, PyObject *unused) { return t_list(t, 2); }

static PyObject *
Table_iter(U64Table *t)
{
    PyObject *keys = t_list(t, 0);
    if (keys == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *
Table_sizeof(U64Table *t, PyObject *unused)
{
    return PyLong_FromSize_t(sizeof(U64Table) + t->table_bytes);
}

/* ---- RadixIndex.store's loop over brand-new blocks ----------------------------------------
 *
 * Engines report blocks they just computed, so nearly every stored block is new to the index:
 * no other holder, no children, no stats to merge. BlockTable.store_new builds those Blocks
 * here, exactly as RadixIndex.store's Python loop does (radix.py, "a new block"), and stops at
 * the first key the index already has; the Python loop handles that one and calls again.
 * Block is a Python class with __slots__; its six slots are written at their member offsets,
 * found once per class from its member descriptors. */

enum { BLK_KEY, BLK_PARENT, BLK_CHILDREN, BLK_HOLDERS, BLK_LAST_ACCESS, BLK_HITS, BLK_NSLOTS };
static const char *const block_slot_names[BLK_NSLOTS] = {"key", "parent", "children", "holders", "last_access", "hits"};
static PyTypeObject *block_type; /* strong reference; the class the offsets belong to */
static Py_ssize_t block_offsets[BLK_NSLOTS];

#define BLK_SLOT(obj, which) (*(PyObject **)((char *)(obj) + block_offsets[which]))

/* 0 once `type`'s slot offsets are known, -1 with TypeError if it is no plain __slots__ class */
static int
block_layout(PyTypeObject *type)
{
    if (type == block_type)
        return 0;
    Py_ssize_t offsets[BLK_NSLOTS];
    for (int k = 0; k < BLK_NSLOTS; k++) {
        PyObject *descr = PyObject_GetAttrString((PyObject *)type, block_slot_names[k]);
        if (descr == NULL)
            return -1;
        offsets[k] = -1;
        if (Py_IS_TYPE(descr, &PyMemberDescr_Type) && PyType_IsSubtype(type, PyDescr_TYPE(descr))) {
            PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
            if (member->type == T_OBJECT_EX && !(member->flags & READ_RESTRICTED))
                offsets[k] = member->offset;
        }
        Py_DECREF(descr);
        if (offsets[k] < 0) {
            PyErr_Format(PyExc_TypeError, "%.100s.%s is not a __slots__ member", type->tp_name, block_slot_names[k]);
            return -1;
        }
    }
    Py_XSETREF(block_type, (PyTypeObject *)Py_NewRef(type));
    memcpy(block_offsets, offsets, sizeof offsets);
    return 0;
}

/* Blocks built by store_new are not tracked by the cycle collector (below), so the table breaks
 * the parent <-> children cycles of the blocks it holds when it is released: each block's
 * `parent` and `children` become None. Without this, a dropped index would leak its tree. */
static void
blocks_unlink(U64Table *t)
{
    if (block_type == NULL)
        return;
    for (Py_ssize_t i = 0; i < t->capacity; i++) {
        if (!t_used(t, i))
            continue;
        PyObject *node = T_OBJ(t, i);
        if (Py_TYPE(node) != block_type)
            continue;
        /* the table keeps the node alive, so clearing can free at most a children dict */
        PyObject *parent = BLK_SLOT(node, BLK_PARENT), *children = BLK_SLOT(node, BLK_CHILDREN);
        BLK_SLOT(node, BLK_PARENT) = Py_NewRef(Py_None);
        BLK_SLOT(node, BLK_CHILDREN) = Py_NewRef(Py_None);
        Py_XDECREF(parent);
        Py_XDECREF(children);
    }
}

/* parent.children gains `node` (None -> the node, one Block -> {key: block, ...}, dict -> item) */
static int
block_link_child(PyObject *parent, PyObject *key_obj, PyObject *node)
{
    PyObject *c = BLK_SLOT(parent, BLK_CHILDREN);
    if (c == NULL || c == Py_None) {
        Py_XSETREF(BLK_SLOT(parent, BLK_CHILDREN), Py_NewRef(node));
        return 0;
    }
    if (PyDict_CheckExact(c))
        return PyDict_SetItem(c, key_obj, node);
    if (Py_TYPE(c) != block_type || BLK_SLOT(c, BLK_KEY) == NULL) {
        PyErr_SetString(PyExc_TypeError, "children is neither None, a Block nor a dict");
        return -1;
    }
    PyObject *both = PyDict_New();
    if (both == NULL || PyDict_SetItem(both, BLK_SLOT(c, BLK_KEY), c) < 0 || PyDict_SetItem(both, key_obj, node) < 0) {
        Py_XDECREF(both);
        return -1;
    }
    Py_SETREF(BLK_SLOT(parent, BLK_CHILDREN), both);
    return 0;
}

/* store_new(block_type, parent, keys, start, bit, now, leaves, chain) -> int
 *
 * From keys[start] on, while the key is not in the table: a new Block(key, parent) held by
 * `bit` alone (holders = bit, last_access = now, hits = 0) goes into the table, under
 * `parent`, into `leaves` (its parent leaves it if `bit` holds the parent) and onto `chain`;
 * it is the next key's parent. Returns the index of the first key the table already holds
 * (len(keys) when none). */
static PyObject *
BlockTable_store_new(U64Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "store_new(block_type, parent, keys, start, bit, now, leaves, chain)");
        return NULL;
    }
    PyObject *type = args[0], *parent = args[1], *keys = args[2], *bit = args[4], *now = args[5];
    PyObject *leaves = args[6], *chain = args[7];
    if (!t->owns_values) {
        PyErr_SetString(PyExc_TypeError, "store_new is a BlockTable method");
        return NULL;
    }
    if (!PyType_Check(type) || block_layout((PyTypeObject *)type) < 0)
        return NULL;
    if (!PyList_CheckExact(keys) || !PyList_CheckExact(chain) || !PySet_CheckExact(leaves) || !PyLong_CheckExact(bit)) {
        PyErr_SetString(PyExc_TypeError, "keys and chain are lists, leaves a set, bit an int");
        return NULL;
    }
    if (parent != Py_None && Py_TYPE(parent) != block_type) {
        PyErr_SetString(PyExc_TypeError, "parent is None or a Block");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[3]);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (i < 0)
        i = 0;
    Py_INCREF(parent); /* ours while Python code (a collection's finalizers) may run */
    for (; i < PyList_GET_SIZE(keys); i++) {
        PyObject *key_obj = PyList_GET_ITEM(keys, i);
        uint64_t key;
        if (t_key_strict(key_obj, &key) < 0)
            goto error;
        if (t_find(t, key) >= 0)
            break;
        Py_INCREF(key_obj);
        PyObject *node = block_type->tp_alloc(block_type, 0);
        if (node == NULL) {
            Py_DECREF(key_obj);
            goto error;
        }
        BLK_SLOT(node, BLK_KEY) = key_obj;
        BLK_SLOT(node, BLK_PARENT) = Py_NewRef(parent);
        BLK_SLOT(node, BLK_CHILDREN) = Py_NewRef(Py_None);
        BLK_SLOT(node, BLK_HOLDERS) = Py_NewRef(bit);
        BLK_SLOT(node, BLK_LAST_ACCESS) = Py_NewRef(now);
        BLK_SLOT(node, BLK_HITS) = PyLong_FromLong(0);
        /* Not tracked by the cycle collector: its parent/children cycles are broken explicitly
         * (RadixIndex prunes a block it drops; blocks_unlink when the table goes), and a
         * million tracked blocks made every full collection walk them all (half of ingest
         * time went to the collector). */
        PyObject_GC_UnTrack(node);
        /* the allocation may have run a collection: look again before inserting */
        if (t_find(t, key) >= 0 || t_reserve_one(t) < 0) {
            Py_DECREF(node);
            if (PyErr_Occurred())
                goto error;
            break;
        }
        t_insert(t, key, (uint64_t)(uintptr_t)node); /* the table owns the new reference */
        if (parent != Py_None) {
            if (block_link_child(parent, key_obj, node) < 0)
                goto error; /* the node stays in the table, as a Python error midway would leave it */
            PyObject *held = PyNumber_And(BLK_SLOT(parent, BLK_HOLDERS), bit);
            int is_held = held == NULL ? -1 : PyObject_IsTrue(held);
            Py_XDECREF(held);
            if (is_held < 0 || (is_held && PySet_Discard(leaves, parent) < 0))
                goto error;
        }
        if (PySet_Add(leaves, node) < 0 || PyList_Append(chain, node) < 0)
            goto error;
        Py_SETREF(parent, Py_NewRef(node));
    }
    Py_DECREF(parent);
    return PyLong_FromSsize_t(i);
error:
    Py_DECREF(parent);
    return NULL;
}

/* map_pairs(sources, targets) -> int: self[s] = t for each pair of the two sequences where
 * s != t (an engine hash that is the block key itself needs no entry); returns how many were
 * set. Both are validated before anything changes. The per-block loop of Router.apply's
 * engine-hash bookkeeping. */
static PyObject *
U64Map_map_pairs(U64Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (t->owns_values) {
        PyErr_SetString(PyExc_TypeError, "map_pairs is a U64Map method");
        return NULL;
    }
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "map_pairs(sources, targets)");
        return NULL;
    }
    PyObject *src = PySequence_Fast(args[0], "sources must be a sequence");
    if (src == NULL)
        return NULL;
    PyObject *dst = PySequence_Fast(args[1], "targets must be a sequence");
    if (dst == NULL) {
        Py_DECREF(src);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(src);
    if (PySequence_Fast_GET_SIZE(dst) < n)
        n = PySequence_Fast_GET_SIZE(dst); /* as zip() */
    uint64_t *pairs = PyMem_Malloc(sizeof(uint64_t) * 2 * (size_t)(n ? n : 1));
    Py_ssize_t set = 0;
    if (pairs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (t_key_strict(PySequence_Fast_GET_ITEM(src, i), &pairs[2 * i]) < 0
            || t_key_strict(PySequence_Fast_GET_ITEM(dst, i), &pairs[2 * i + 1]) < 0)
            goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key = pairs[2 * i], value = pairs[2 * i + 1];
        if (key == value)
            continue;
        Py_ssize_t at = t_find(t, key);
        if (at < 0) {
            if (t_reserve_one(t) < 0)
                goto done;
            t_insert(t, key, value);
        }
        else
            T_VAL(t, at) = value;
        set++;
    }
done:
    PyMem_Free(pairs);
    Py_DECREF(src);
    Py_DECREF(dst);
    return PyErr_Occurred() ? NULL : PyLong_FromSsize_t(set);
}

static PyMethodDef Table_methods[] = {
    {"get", (PyCFunction)(void (*)(void))Table_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))Table_pop, METH_FASTCALL, "pop(key[, default])"},
    {"clear", (PyCFunction)Table_clear, METH_NOARGS, "remove every entry and release the table"},
    {"keys", (PyCFunction)Table_keys, METH_NOARGS, "a list of the keys"},
    {"values", (PyCFunction)Table_values, METH_NOARGS, "a list of the values"},
    {"items", (PyCFunction)Table_items, METH_NOARGS, "a list of (key, value) pairs"},
    {"__sizeof__", (PyCFunction)Table_sizeof, METH_NOARGS, "bytes used, tables included"},
    {"map_pairs", (PyCFunction)(void (*)(void))U64Map_map_pairs, METH_FASTCALL,
     "map_pairs(sources, targets) -> int: self[s] = t for each pair with s != t; how many were set"},
    {"store_new", (PyCFunction)(void (*)(void))BlockTable_store_new, METH_FASTCALL,
     "store_new(block_type, parent, keys, start, bit, now, leaves, chain) -> index of the first key already held"},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods Table_as_mapping = {
    (lenfunc)Table_len, (binaryfunc)Table_subscript, (objobjargproc)Table_ass_subscript,
};

static PySequenceMethods Table_as_sequence = {
    .sq_contains = (objobjproc)Table_contains,
};

static PyTypeObject U64MapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvrouterd.index._native.U64Map",
    .tp_doc = "A compact dict of uint64 -> uint64 (keys and values 0 <= x < 2**64).",
    .tp_basicsize = sizeof(U64Table),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = U64Map_new,
    .tp_dealloc = (destructor)U64Map_dealloc,
    .tp_as_mapping = &Table_as_mapping,
    .tp_as_sequence = &Table_as_sequence,
    .tp_iter = (getiterfunc)Table_iter,
    .tp_methods = Table_methods,
};

static PyTypeObject BlockTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvrouterd.index._native.BlockTable",
    .tp_doc = "A compact dict of uint64 key -> object (RadixIndex's blocks); match_walk reads it directly.",
    .tp_basicsize = sizeof(U64Table),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = BlockTable_new,
    .tp_dealloc = (destructor)BlockTable_dealloc,
    .tp_traverse = (traverseproc)BlockTable_traverse,
    .tp_clear = (inquiry)BlockTable_clear_refs,
    .tp_as_mapping = &Table_as_mapping,
    .tp_as_sequence = &Table_as_sequence,
    .tp_iter = (getiterfunc)Table_iter,
    .tp_methods = Table_methods,
};

static PyObject *match_walk_table(U64Table *t, const uint64_t *keys, Py_ssize_t nkeys, unsigned long long active);
static PyObject *match_walk_table_seq(U64Table *t, PyObject *seq, unsigned long long active);

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

/* One block of a walk at `depth`: intersect `*active` with the block's holders (`holders_obj`,
 * a new reference, consumed), recording `depth` as the overlap of every slot that drops out.
 * 1: no slot is left and the walk ends; 0: go on; -1: error. */
static int
walk_step(PyObject *overlaps, unsigned long long *active, PyObject *holders_obj, Py_ssize_t depth)
{
    /* only the low 64 bits can intersect `active` */
    unsigned long long holders = PyLong_AsUnsignedLongLongMask(holders_obj);
    Py_DECREF(holders_obj);
    if (holders == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    unsigned long long still = *active & holders;
    if (still != *active) {
        if (depth && set_overlaps(overlaps, *active ^ still, depth) < 0)
            return -1;
        *active = still;
        if (!still)
            return 1;
    }
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
    int is_table = Py_IS_TYPE(blocks, &BlockTableType);
    if (!is_table && !PyDict_Check(blocks)) {
        PyErr_SetString(PyExc_TypeError, "blocks must be a dict or a BlockTable");
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

    if (is_table && PyObject_CheckBuffer(args[1])) {
        /* array('Q') / numpy uint64 keys (Route's path): read in place, no int objects */
        Py_buffer view;
        if (PyObject_GetBuffer(args[1], &view, PyBUF_FORMAT | PyBUF_ND) < 0) {
            /* not a C-contiguous buffer: read it as a sequence of ints, like the Python walk */
            PyErr_Clear();
            goto as_sequence;
        }
        const char *fmt = view.format ? view.format : "B";
        size_t fmt_len = strlen(fmt);
        char code = fmt_len ? fmt[fmt_len - 1] : 'B';
        int native_order = fmt[0] != '>' && fmt[0] != '!';
        if (view.ndim > 1 || view.itemsize != 8 || (code != 'Q' && code != 'L') || !native_order) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "buffer keys must be one-dimensional native-endian uint64 (array('Q'))");
            return NULL;
        }
        PyObject *result = match_walk_table((U64Table *)blocks, (const uint64_t *)view.buf, view.len / 8, active);
        PyBuffer_Release(&view);
        return result;
    }
as_sequence:;
    PyObject *seq = PySequence_Fast(args[1], "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    if (is_table) {
        PyObject *result = match_walk_table_seq((U64Table *)blocks, seq, active);
        Py_DECREF(seq);
        return result;
    }
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
        /* owned from here: any allocation may run a collection whose finalizers change `blocks` */
        Py_INCREF(node);
        PyObject *holders_obj = PyObject_GetAttr(node, holders_name);
        int step = holders_obj == NULL ? -1 : walk_step(overlaps, &active, holders_obj, depth);
        if (step == 0 && PyList_Append(path, node) < 0)
            step = -1;
        Py_DECREF(node);
        if (step < 0)
            goto error;
        if (step > 0)
            break;
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

/* ---- the match walk over a BlockTable, with the memory latency overlapped -----------------
 *
 * In a 10^6-block index every block of the walk is a cache miss or three: the table slot, the
 * Block, its holders int. The keys are all known up front, so instead of paying them one after
 * another, the walk prefetches: table slots WALK_AHEAD keys ahead, then each found Block and its
 * holders int a few blocks ahead of where the mask is intersected.
 */
#define WALK_AHEAD 8
#define WALK_NODE_AHEAD 6
#define WALK_HOLDERS_AHEAD 3

static Py_ssize_t holders_offset_for(PyTypeObject *type);

/* keys given as int objects: converted, up to the first that can't be a key (outside uint64) */
static PyObject *
match_walk_table_seq(U64Table *t, PyObject *seq, unsigned long long active)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t *keys = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (keys == NULL)
        return PyErr_NoMemory();
    Py_ssize_t nkeys = 0;
    for (; nkeys < n; nkeys++) {
        int r = t_key(items[nkeys], &keys[nkeys]);
        if (r < 0) {
            PyMem_Free(keys);
            return NULL;
        }
        if (r == 1)
            break;
    }
    PyObject *result = match_walk_table(t, keys, nkeys, active);
    PyMem_Free(keys);
    return result;
}

static PyObject *
match_walk_table(U64Table *t, const uint64_t *keys, Py_ssize_t nkeys, unsigned long long active)
{
    Py_ssize_t found = 0;
    PyObject **nodes = PyMem_Malloc((size_t)(nkeys ? nkeys : 1) * sizeof(PyObject *));
    PyObject *overlaps = PyDict_New();
    PyObject *path = NULL;
    if (nodes == NULL || overlaps == NULL) {
        if (nodes == NULL)
            PyErr_NoMemory();
        goto error;
    }
    /* pass 1: the blocks present, up to the first key the index does not have */
    for (Py_ssize_t i = 0; i < nkeys && i < WALK_AHEAD; i++)
        __builtin_prefetch(&T_KEY(t, t_home(keys[i], t->capacity)));
    for (; found < nkeys; found++) {
        if (found + WALK_AHEAD < nkeys)
            __builtin_prefetch(&T_KEY(t, t_home(keys[found + WALK_AHEAD], t->capacity)));
        Py_ssize_t slot = t_find(t, keys[found]);
        if (slot < 0)
            break;
        /* owned: pass 2 allocates, and a collection's finalizers could change the table */
        nodes[found] = Py_NewRef(T_OBJ(t, slot));
    }
    /* pass 2: intersect holder masks along the path */
    Py_ssize_t offset = found ? holders_offset_for(Py_TYPE(nodes[0])) : -1;
    for (Py_ssize_t i = 0; offset >= 0 && i < found && i < WALK_NODE_AHEAD; i++)
        __builtin_prefetch((char *)nodes[i] + offset);
    Py_ssize_t depth = 0;
    for (; depth < found; depth++) {
        PyObject *node = nodes[depth];
        PyObject *holders_obj;
        if (offset >= 0 && Py_TYPE(node) == Py_TYPE(nodes[0])) {
            if (depth + WALK_NODE_AHEAD < found)
                __builtin_prefetch((char *)nodes[depth + WALK_NODE_AHEAD] + offset);
            if (depth + WALK_HOLDERS_AHEAD < found && Py_TYPE(nodes[depth + WALK_HOLDERS_AHEAD]) == Py_TYPE(node)) {
                PyObject *ahead = *(PyObject **)((char *)nodes[depth + WALK_HOLDERS_AHEAD] + offset);
                if (ahead != NULL)
                    __builtin_prefetch(ahead);
            }
            holders_obj = *(PyObject **)((char *)node + offset);
            if (holders_obj == NULL) {
                PyErr_SetString(PyExc_AttributeError, "holders");
                goto error;
            }
            Py_INCREF(holders_obj);
        }
        else {
            holders_obj = PyObject_GetAttr(node, holders_name);
            if (holders_obj == NULL)
                goto error;
        }
        int step = walk_step(overlaps, &active, holders_obj, depth);
        if (step < 0)
            goto error;
        if (step > 0)
            break;
    }
    if (depth && set_overlaps(overlaps, active, depth) < 0)
        goto error;
    path = PyList_New(depth);
    if (path == NULL)
        goto error;
    for (Py_ssize_t i = 0; i < depth; i++)
        PyList_SET_ITEM(path, i, nodes[i]); /* the path takes over these references */
    for (Py_ssize_t i = depth; i < found; i++)
        Py_DECREF(nodes[i]);
    PyMem_Free(nodes);
    PyObject *result = PyTuple_Pack(2, overlaps, path);
    Py_DECREF(overlaps);
    Py_DECREF(path);
    return result;

error:
    if (nodes != NULL) {
        for (Py_ssize_t i = 0; i < found; i++)
            Py_DECREF(nodes[i]);
    }
    PyMem_Free(nodes);
    Py_XDECREF(overlaps);
    Py_XDECREF(path);
    return NULL;
}

/* Byte offset of the `holders` slot in instances of `type` (a __slots__ member), or -1 when
 * it is not a plain object slot (then the walk reads it with getattr). One lookup per walk. */
static Py_ssize_t
holders_offset_for(PyTypeObject *type)
{
    PyObject *descr = PyObject_GetAttr((PyObject *)type, holders_name);
    if (descr == NULL) {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t offset = -1;
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type) && PyType_IsSubtype(type, PyDescr_TYPE(descr))) {
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type == T_OBJECT_EX && !(member->flags & READ_RESTRICTED))
            offset = member->offset;
    }
    Py_DECREF(descr);
    return offset;
}

/* chain_split(blocks, prio) -> (continued, ends): for a stored chain, the blocks the chain
 * continues from (blocks[i + 1].parent is blocks[i], so block i has a held child) whose key
 * is in the dict `prio`, and the blocks it does not continue from (the last one included).
 * The per-block loop of the leaf tracker's `stored` hook (policies/eviction/_leaves.py). */
static PyObject *
chain_split(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_CheckExact(args[0]) || !PyDict_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "chain_split(blocks: list, prio: dict)");
        return NULL;
    }
    PyObject *blocks = args[0], *prio = args[1];
    PyObject *continued = PyList_New(0), *ends = PyList_New(0);
    if (continued == NULL || ends == NULL)
        goto error;
    Py_INCREF(blocks); /* ours while a foreign descriptor or __eq__ may run Python code */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        int links = 0;
        Py_INCREF(b);
        if (i + 1 < PyList_GET_SIZE(blocks)) {
            PyObject *next = PyList_GET_ITEM(blocks, i + 1);
            PyObject *parent;
            if (block_type != NULL && Py_TYPE(next) == block_type)
                parent = Py_XNewRef(BLK_SLOT(next, BLK_PARENT));
            else
                parent = PyObject_GetAttrString(next, "parent");
            if (parent == NULL) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_AttributeError, "parent");
                Py_DECREF(b);
                goto error_owned;
            }
            links = parent == b;
            Py_DECREF(parent);
        }
        int r;
        if (links) {
            PyObject *key = block_type != NULL && Py_TYPE(b) == block_type ? Py_XNewRef(BLK_SLOT(b, BLK_KEY))
                                                                           : PyObject_GetAttrString(b, "key");
            r = key == NULL ? -1 : PyDict_Contains(prio, key);
            Py_XDECREF(key);
            if (r > 0)
                r = PyList_Append(continued, b);
        }
        else
            r = PyList_Append(ends, b);
        Py_DECREF(b);
        if (r < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_AttributeError, "key");
            goto error_owned;
        }
    }
    Py_DECREF(blocks);
    PyObject *pair = PyTuple_Pack(2, continued, ends);
    Py_DECREF(continued);
    Py_DECREF(ends);
    return pair;
error_owned:
    Py_DECREF(blocks);
error:
    Py_XDECREF(continued);
    Py_XDECREF(ends);
    return NULL;
}

static PyMethodDef native_methods[] = {
    {"chain_keys", (PyCFunction)(void (*)(void))chain_keys, METH_FASTCALL,
     "chain_keys(data, block_size, seed, limit) -> list[int]: chained xxh3-64 keys of the full blocks."},
    {"chain_keys_packed", (PyCFunction)(void (*)(void))chain_keys_packed, METH_FASTCALL,
     "chain_keys_packed(data, block_size, seed, limit) -> bytes: the keys as native-endian uint64s."},
    {"chain_split", (PyCFunction)(void (*)(void))chain_split, METH_FASTCALL,
     "chain_split(blocks, prio) -> (continued blocks whose key is in prio, blocks not continued)"},
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
    if (holders_name == NULL || PyType_Ready(&U64MapType) < 0 || PyType_Ready(&BlockTableType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "U64Map", (PyObject *)&U64MapType) < 0
        || PyModule_AddObjectRef(module, "BlockTable", (PyObject *)&BlockTableType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
