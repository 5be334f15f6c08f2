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
 * A cached block costs memory once per block in the whole fleet's cache, so the index's own
 * structures are here too: Block (RadixIndex's node: 64 bytes, its key inline, outside the cycle
 * collector), BlockTable (RadixIndex's key -> Block map: a tagged pointer per slot, ~12 bytes a
 * block) and U64Map (the engine-hash -> key map of every event-driven worker: ~24 bytes an
 * entry, where a dict spends ~41 plus an int object per key). The match walk reads a BlockTable
 * and its Blocks directly, prefetching ahead of itself.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <string.h>
#include <sys/mman.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

static PyObject *holders_name; /* interned "holders" */
static PyObject *float_zero;   /* 0.0: a new Block's last_access */
static PyObject *zero;         /* 0: a new Block's hits */
static PyObject *one;          /* 1: a touch's hits */
static PyObject *empty_str;    /* "": a Decision's unset names */
static PyObject *minus_one;    /* -1: chain_keys_packed's "no limit" */
static PyObject *array_q_zero; /* array('Q', [0]): u64_array repeats it into its result */
static PyObject *pending_name; /* interned "_pending" */
/* RadixIndex.recency (set_leaf_recency), which LeafOrder.stored computes itself where it can */
static PyObject *leaf_recency_ref;

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

/* A new array('Q') of the `count` keys of `data` chained from `seed` (chain_into), hashed into
 * the array itself: array's own repeat makes it without array()'s argument parsing */
static PyObject *
chain_array(const char *data, Py_ssize_t step, Py_ssize_t count, uint64_t seed)
{
    Py_buffer into;
    PyObject *out = PySequence_Repeat(array_q_zero, count);
    if (out == NULL || PyObject_GetBuffer(out, &into, PyBUF_WRITABLE) < 0) {
        Py_XDECREF(out);
        return NULL;
    }
    chain_into(data, step, count, seed, (uint64_t *)into.buf);
    PyBuffer_Release(&into);
    return out;
}

/* chain_keys_array(data, block_size, seed, limit) -> array('Q'): the same keys in the array a
 * Route keeps them in, without a bytes object parsed and copied into one (~1,600 instructions a
 * Route, keys.chain_keys_array's array("Q", bytes)) */
static PyObject *
chain_keys_array(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    Py_ssize_t step, count;
    uint64_t seed;
    if (chain_args(args, nargs, &view, &step, &count, &seed) < 0)
        return NULL;
    PyObject *out = chain_array((const char *)view.buf, step, count, seed);
    PyBuffer_Release(&view);
    return out;
}

/* ---- a huge Route's prompt, hashed off the event loop (issue #16 item 1) -----------------
 *
 * wire_prompt_keys(data, spans, packed, block_size, seed, max_tokens) -> (tokens, keys | None)
 *
 * `data` is a received RouteRequest's bytes; `spans` the (start, end) offsets of its prompt
 * field's payloads (server/convert.py: split_route finds them): the one token_ids_le32 payload
 * (`packed`), or the packed-varint token_ids chunks in order. Returns the prompt's token count
 * and its block keys as native-endian uint64 bytes, or (tokens, None) past `max_tokens` without
 * hashing. Varints decode as upb decodes a uint32: up to 10 bytes, truncated to the low 32 bits;
 * a malformed chunk is ValueError. The GIL is released for the decoding and the hashing: `data` is
 * a bytes object (immutable) whose buffer export is held throughout, and the result is allocated
 * before and filled while no other thread can see it. Called from a worker thread, so the loop
 * keeps routing meanwhile. */
/* Counts the varints of p[0:n]; -1 on one longer than 10 bytes or cut short, as upb refuses
 * them, so a prompt past the limit (never decoded) that is malformed answers upb's error too
 * (a RouteStream message is then refused whole, as its parse would have been). Branch-free:
 * `run` counts the continuation bytes in a row. */
static Py_ssize_t
count_varints(const unsigned char *p, Py_ssize_t n)
{
    Py_ssize_t count = 0;
    unsigned run = 0, bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned more = p[i] >> 7;
        count += more ^ 1;
        run = (run + 1) * more;
        bad |= run >= 10;
    }
    return bad || run ? -1 : count;
}

#define MALFORMED_VARINT "token_ids holds a malformed varint (longer than 10 bytes or cut short)"

/* Decodes the varints of p[0:n] into out; -1 on a varint longer than 10 bytes or cut short. */
static Py_ssize_t
decode_varints(const unsigned char *p, Py_ssize_t n, uint32_t *out)
{
    Py_ssize_t i = 0, k = 0;
    while (i < n) {
        uint64_t v = 0;
        int shift = 0;
        for (;;) {
            if (i >= n || shift >= 70)
                return -1;
            unsigned char b = p[i++];
            v |= (uint64_t)(b & 0x7f) << (shift < 64 ? shift : 63);
            if (b < 0x80)
                break;
            shift += 7;
        }
        uint32_t t = (uint32_t)v;
#if PY_BIG_ENDIAN
        t = __builtin_bswap32(t);
#endif
        out[k++] = t;
    }
    return k;
}

static PyObject *
wire_prompt_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "takes 6 arguments: (data, spans, packed, block_size, seed, max_tokens)");
        return NULL;
    }
    if (!PyBytes_CheckExact(args[0]) || !PyTuple_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "data must be bytes and spans a tuple of (start, end) pairs");
        return NULL;
    }
    int packed = PyObject_IsTrue(args[2]);
    Py_ssize_t block_size = PyLong_AsSsize_t(args[3]);
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[4]);
    Py_ssize_t max_tokens = PyLong_AsSsize_t(args[5]);
    if (packed < 0 || PyErr_Occurred())
        return NULL;
    if (block_size <= 0 || block_size > PY_SSIZE_T_MAX / 4 || max_tokens < 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be > 0 and max_tokens >= 0");
        return NULL;
    }
    const unsigned char *base = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t size = PyBytes_GET_SIZE(args[0]);
    Py_ssize_t nspans = PyTuple_GET_SIZE(args[1]);
    if (packed && nspans != 1) {
        PyErr_SetString(PyExc_ValueError, "a packed prompt is one span");
        return NULL;
    }
    Py_ssize_t *bounds = PyMem_Malloc((size_t)(nspans ? nspans : 1) * 2 * sizeof(Py_ssize_t));
    if (bounds == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t s = 0; s < nspans; s++) {
        PyObject *pair = PyTuple_GET_ITEM(args[1], s);
        Py_ssize_t a = -1, b = -1;
        if (PyTuple_CheckExact(pair) && PyTuple_GET_SIZE(pair) == 2) {
            a = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 0));
            b = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 1));
        }
        if (PyErr_Occurred() || a < 0 || b < a || b > size) {
            PyMem_Free(bounds);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "spans must be (start, end) pairs inside data");
            return NULL;
        }
        bounds[2 * s] = a;
        bounds[2 * s + 1] = b;
    }
    /* data is immutable: holding a reference (the caller's) keeps it alive, and counting needs no GIL */
    Py_ssize_t tokens = 0;
    if (packed) {
        tokens = (bounds[1] - bounds[0]) / 4;
    }
    else {
        Py_ssize_t got = 0;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t s = 0; s < nspans && got >= 0; s++) {
            got = count_varints(base + bounds[2 * s], bounds[2 * s + 1] - bounds[2 * s]);
            tokens += got;
        }
        Py_END_ALLOW_THREADS
        if (got < 0) {
            PyMem_Free(bounds);
            PyErr_SetString(PyExc_ValueError, MALFORMED_VARINT);
            return NULL;
        }
    }
    if (tokens > max_tokens) {
        PyMem_Free(bounds);
        return Py_BuildValue("(nO)", tokens, Py_None);
    }
    Py_ssize_t count = tokens / block_size;
    PyObject *keys = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(uint64_t));
    uint32_t *decoded = NULL;
    if (keys != NULL && !packed) {
        decoded = PyMem_RawMalloc((size_t)(tokens ? tokens : 1) * sizeof(uint32_t));
        if (decoded == NULL) {
            Py_CLEAR(keys);
            PyErr_NoMemory();
        }
    }
    if (keys == NULL) {
        PyMem_Free(bounds);
        return NULL;
    }
    int malformed = 0;
    uint64_t *out = (uint64_t *)PyBytes_AS_STRING(keys);
    Py_BEGIN_ALLOW_THREADS
    if (packed) {
        chain_into((const char *)base + bounds[0], block_size * 4, count, (uint64_t)seed, out);
    }
    else {
        Py_ssize_t k = 0;
        for (Py_ssize_t s = 0; s < nspans && !malformed; s++) {
            Py_ssize_t got = decode_varints(base + bounds[2 * s], bounds[2 * s + 1] - bounds[2 * s], decoded + k);
            if (got < 0)
                malformed = 1;
            else
                k += got;
        }
        if (!malformed)
            chain_into((const char *)decoded, block_size * 4, count, (uint64_t)seed, out);
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(decoded);
    PyMem_Free(bounds);
    if (malformed) {
        Py_DECREF(keys);
        PyErr_SetString(PyExc_ValueError, MALFORMED_VARINT);
        return NULL;
    }
    PyObject *result = Py_BuildValue("(nN)", tokens, keys);
    return result;
}

/* ---- U64Map: an open-addressing uint64 -> uint64 table -----------------------------------
 *
 * The engine-hash -> key map. Entries are (key, value) pairs in one array, so a lookup touches
 * one cache line; linear probing, backward-shift deletion (no
 * tombstones). Any uint64 can be a key, so occupancy is a bitmap rather than a reserved key.
 * Capacity is any size >= 8 (slots are chosen by multiply-shift, not a power-of-two mask) and
 * grows by half when the load would pass 0.8, so the load stays between 0.53 and 0.8: 16.125
 * bytes per slot, about 24 per entry, where a dict spends ~41 per entry plus an int object
 * per key. Keys are mixed (murmur3's fmix64) first: sequential keys must not cluster.
 *
 * Growth is incremental (issue #16 item 1: re-inserting every entry inside the one call that
 * crossed the load took ~10 ms at 350k entries, and the global BlockTable below pays the same
 * for millions). The full array stays as `old` beside a larger `cur`; every insert and delete
 * then moves the entries of at most MIGRATE_SLOTS old slots into `cur`, and lookups read `cur`
 * first, then `old`. A key is in exactly one of the two. The old array is emptied from the end
 * of its probe runs: the walk goes down from a free slot, so the slot above the one it looks at
 * is always free (free at the start, or emptied by the walk), and an entry there is the last of
 * its run, which leaves without shifting any other entry back: `old` stays a valid linear-probing
 * array that lookups and deletes (backward shift, which never crosses the free slots above the
 * walk) use as before. Every insert moves MIGRATE_SLOTS slots and the next growth is 0.4 x the
 * old capacity inserts away (0.5 x for LeafOrder's half-full table, which doubles), so a
 * migration is always over before the next one starts (2.5 slots an insert would do).
 *
 * The kernel's share is paced too. A new array of TABLE_MMAP_BYTES or more is mapped ahead, as
 * `next`, once the load passes 0.75 (sparse: 0.45), and populated a chunk at a time as inserts
 * and deletes go by, at a pace that has it done halfway to the load that grows the table
 * (TablePace). Mapped at the growth itself, the migration's and the new entries' first writes
 * faulted its pages in by trap, two faults a page (a read maps the zero page first): ~8 ms in
 * each of the first calls after a growth at 10^6 blocks; MAP_POPULATE instead is one call of
 * ~25-50 ms for a 64 MiB array (~3 us a page on this 2-core VM under load, issue #12). The old
 * array, once empty, is unmapped a chunk at a time the same way: unmapping 27 MB at once took
 * ~5-7 ms (~0.7-1 us a page). __sizeof__ counts the pages held: next's populated part, what is
 * left of the old mapping.
 */
/* A mapping populated (a table's next array) or unmapped (an emptied old one) a chunk at a time:
 * every insert or delete earns `step` bytes, done in whole TABLE_CHUNKs. */
typedef struct {
    char *base;    /* NULL: nothing under way */
    size_t bytes;  /* the mapping's length */
    size_t done;   /* bytes populated / unmapped so far, from the start */
    size_t credit; /* bytes earned and not done yet */
    size_t step;   /* bytes an insert or delete earns */
} TablePace;

typedef struct {
    uint64_t *entries; /* capacity (key, value) pairs */
    uint64_t *used;    /* bitmap over slots */
    Py_ssize_t capacity;
    Py_ssize_t size;
    void *table; /* entries and used, one allocation; NULL: no array */
    size_t table_bytes;
} U64Slots;

/* a growing uint64 -> uint64 table: U64Map's and LeafOrder's */
typedef struct {
    U64Slots cur;      /* where new entries go */
    U64Slots old;      /* the smaller array being emptied into cur (old.table NULL when none) */
    U64Slots next;     /* the array the next growth takes, mapped ahead (next.table NULL when none) */
    Py_ssize_t cursor; /* the old slot the migration looked at last; it goes on below it */
    TablePace fill;    /* next's mapping, being populated */
    TablePace drain;   /* an emptied old array's mapping, being unmapped */
    int sparse;        /* kept at most half full, doubling (LeafOrder), rather than 0.8 growing by half */
} U64Store;

typedef struct {
    PyObject_HEAD
    U64Store s;
} U64Table;

#define T_KEY(a, i) ((a)->entries[2 * (size_t)(i)])
#define T_VAL(a, i) ((a)->entries[2 * (size_t)(i) + 1])

#define TABLE_MIN_CAPACITY 8
/* Old slots a growing table empties into its new array per insert or delete: enough that a
 * migration ends long before the next growth (see above; a probe that misses in the new array
 * reads the old one too until then), small enough that a call storing 512 blocks moves at most
 * ~13k entries of 16k slots (~1 ms, each of a BlockTable's a Block's key read from memory). */
#define MIGRATE_SLOTS 32
/* Tables this large are mmap'ed: a freed one goes back to the OS at once. From the heap, the
 * tables a growing map leaves behind stayed resident (glibc raises its mmap threshold after the
 * first free), which doubled a map's RSS at 10^6 entries. */
#define TABLE_MMAP_BYTES (1 << 20)
/* a mapping is populated or unmapped in chunks this large (~0.2 ms a chunk): a system call has a
 * cost of its own (populating page by page took ~4-8 us a page, ~3 us a page in chunks) */
#define TABLE_CHUNK (256 << 10)
/* bytes of an emptied old array unmapped per insert or delete (a chunk every 256): a 27 MB array
 * is gone ~27k inserts later, long before the next growth (0.4 x its capacity) */
#define TABLE_DRAIN_STEP 1024

/* `bytes` zero-filled: from the heap below TABLE_MMAP_BYTES, else mmap'ed, and populated at once
 * when `populate` (a table sized ahead for a count it will be filled to in the next parts) */
static void *
table_alloc(size_t bytes, int populate)
{
    if (bytes < TABLE_MMAP_BYTES)
        return PyMem_Calloc(1, bytes);
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | (populate ? MAP_POPULATE : 0), -1, 0);
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

/* start pacing the mapping `base` (`bytes` long): `step` bytes an insert or delete */
static void
pace_start(TablePace *p, void *base, size_t bytes, size_t step)
{
    *p = (TablePace){(char *)base, bytes, 0, 0, step ? step : 1};
}

/* One insert's or delete's share of `p` (all of what is left when `all`): populated
 * (MADV_POPULATE_WRITE, or where Linux lacks it (< 5.14) a write a page, the same faults) or,
 * when `unmap`, unmapped. Done, the pace ends (base NULL). */
static void
pace_run(TablePace *p, int unmap, int all)
{
    if (p->base == NULL)
        return;
    p->credit += all ? p->bytes : p->step;
    while (p->done < p->bytes && (p->credit >= TABLE_CHUNK || p->done + p->credit >= p->bytes)) {
        size_t n = p->bytes - p->done < TABLE_CHUNK ? p->bytes - p->done : TABLE_CHUNK;
        char *at = p->base + p->done;
        if (unmap)
            munmap(at, n); /* the length rounds up to the mapping's last page */
        else {
#ifdef MADV_POPULATE_WRITE
            if (madvise(at, n, MADV_POPULATE_WRITE) < 0)
#endif
                for (size_t off = 0; off < n; off += 4096)
                    *(volatile char *)(at + off) = 0; /* zero already: only the fault matters */
        }
        p->done += n;
        p->credit = p->credit > n ? p->credit - n : 0;
    }
    if (p->done >= p->bytes)
        p->base = NULL;
}

/* bytes a pace still holds: what is left to unmap of a drain */
static inline size_t
pace_left(const TablePace *p)
{
    return p->base == NULL ? 0 : p->bytes - p->done;
}

/* The array `table` (`bytes` long) is empty and no longer read: heap memory freed now, a mapping
 * unmapped by `drain` in steps (what an earlier drain left, if any, at once: it never has any
 * by then, as the steps are far ahead of the growths). */
static void
table_retire(TablePace *drain, void *table, size_t bytes)
{
    if (bytes < TABLE_MMAP_BYTES) {
        table_free(table, bytes);
        return;
    }
    pace_run(drain, 1, 1);
    pace_start(drain, table, bytes, TABLE_DRAIN_STEP);
}

/* the populate pace of a next array of `bytes` mapped `window` inserts before the growth needs
 * it: done halfway there */
static inline size_t
fill_step(size_t bytes, Py_ssize_t window)
{
    return 2 * bytes / (size_t)(window > 1 ? window : 1) + 1;
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
t_used(const U64Slots *a, Py_ssize_t i)
{
    return (int)((a->used[i >> 6] >> (i & 63)) & 1);
}

/* `a` an empty array of `capacity` slots; 0, or -1 (MemoryError, `a` untouched) */
static int
t_alloc(U64Slots *a, Py_ssize_t capacity, int populate)
{
    size_t words = ((size_t)capacity + 63) / 64;
    size_t bytes = ((size_t)capacity * 2 + words) * sizeof(uint64_t);
    uint64_t *table = table_alloc(bytes, populate);
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    a->table = table;
    a->table_bytes = bytes;
    a->entries = table;
    a->used = table + 2 * (size_t)capacity;
    a->capacity = capacity;
    a->size = 0;
    return 0;
}

static void
t_free(U64Slots *a)
{
    table_free(a->table, a->table_bytes);
    *a = (U64Slots){NULL, NULL, 0, 0, NULL, 0};
}

/* The slot of `key`, or, when it is absent, ~f (negative) for the free slot f that ended the
 * search: where linear probing puts `key` (no tombstones, so the first free slot is the place).
 * One probe run answers both the lookup and the insert that follows a miss (issue #12: every
 * engine hash a stored event maps is a miss, and at loads up to 0.8 a miss's run is long). */
static inline Py_ssize_t
t_probe(const U64Slots *a, uint64_t key)
{
    Py_ssize_t i = t_home(key, a->capacity);
    while (t_used(a, i)) {
        if (T_KEY(a, i) == key)
            return i;
        if (++i == a->capacity)
            i = 0;
    }
    return ~i;
}

/* slot of `key`, or -1 */
static inline Py_ssize_t
t_find(const U64Slots *a, uint64_t key)
{
    Py_ssize_t i = t_probe(a, key);
    return i < 0 ? -1 : i;
}

/* A helper that only prefetches is forced inline: GCC (12, at -O1 and up) finds such a function
 * `const` (a prefetch has no side effect it models) before it inlines it, and deletes every call
 * whose result is unused, which is all of them; the match walk's prefetches were never emitted. */
#define PREFETCH_HELPER static inline __attribute__((always_inline)) void

/* How many keys ahead a loop over a stored chain asks for the table slots of the key it will
 * look up (store_run, map_pairs_run, LeafOrder.stored). At 10^5-10^6 entries every lookup of a
 * new key is a cache miss (issue #30: the slot loads of the block table and the engine-hash map
 * were a third of an applied block's time); the keys are known up front, so the misses are
 * fetched side by side instead of one after another. */
#define STORE_AHEAD 8

/* the slot `key`'s probe starts at, and its occupancy word, on their way into cache */
PREFETCH_HELPER
t_prefetch(const U64Slots *a, uint64_t key)
{
    Py_ssize_t i = t_home(key, a->capacity);
    __builtin_prefetch(&T_KEY(a, i), 1);
    __builtin_prefetch(&a->used[i >> 6], 1);
}

/* t_prefetch in cur, and in old while the store grows (a miss in cur reads old too) */
PREFETCH_HELPER
us_prefetch(const U64Store *s, uint64_t key)
{
    t_prefetch(&s->cur, key);
    if (s->old.table != NULL)
        t_prefetch(&s->old, key);
}

/* the first free slot from `i` on (cyclically), read from the occupancy bitmap a word (64 slots)
 * at a time; the array must have one */
static inline Py_ssize_t
t_free_from(const U64Slots *a, Py_ssize_t i)
{
    for (;;) {
        uint64_t free = ~a->used[i >> 6] >> (i & 63);
        if (free) {
            i += __builtin_ctzll(free);
            if (i < a->capacity)
                return i;
            i = 0; /* the last word's bits past the capacity are no slots */
            continue;
        }
        i = (i | 63) + 1;
        if (i >= a->capacity)
            i = 0;
    }
}

/* fill the free slot i */
static inline void
t_place(U64Slots *a, Py_ssize_t i, uint64_t key, uint64_t value)
{
    a->used[i >> 6] |= 1ULL << (i & 63);
    T_KEY(a, i) = key;
    T_VAL(a, i) = value;
    a->size++;
}

/* put `key` (known absent) into a free slot; the array must have one */
static void
t_insert(U64Slots *a, uint64_t key, uint64_t value)
{
    t_place(a, t_free_from(a, t_home(key, a->capacity)), key, value);
}

/* remove the entry in slot i, shifting later members of its probe run back (no tombstones) */
static void
t_erase(U64Slots *a, Py_ssize_t i)
{
    Py_ssize_t cap = a->capacity;
    Py_ssize_t j = i;
    for (;;) {
        if (++j == cap)
            j = 0;
        if (!t_used(a, j))
            break;
        Py_ssize_t home = t_home(T_KEY(a, j), cap);
        /* entry j may fill the hole at i unless its home lies cyclically in (i, j] */
        int home_in_range = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (home_in_range)
            continue;
        T_KEY(a, i) = T_KEY(a, j);
        T_VAL(a, i) = T_VAL(a, j);
        i = j;
    }
    a->used[i >> 6] &= ~(1ULL << (i & 63));
    a->size--;
}

static inline Py_ssize_t
us_len(const U64Store *s)
{
    return s->cur.size + s->old.size;
}

/* an empty store of `capacity` slots; 0 or -1 (MemoryError) */
static int
us_init(U64Store *s, Py_ssize_t capacity, int sparse, int populate)
{
    s->old = s->next = (U64Slots){NULL, NULL, 0, 0, NULL, 0};
    s->cursor = 0;
    s->fill = s->drain = (TablePace){NULL, 0, 0, 0, 0};
    s->sparse = sparse;
    return t_alloc(&s->cur, capacity, populate);
}

static void
us_free(U64Store *s)
{
    t_free(&s->cur);
    t_free(&s->old);
    t_free(&s->next);
    s->fill.base = NULL;
    pace_run(&s->drain, 1, 1);
}

/* The migration's next `budget` old slots, going down from the cursor (cyclically): an entry in
 * one is the last of its probe run (the slot above is free) and moves to cur. The old array is
 * retired once empty. Every step paces the next array's populating and an old mapping's unmapping. */
static void
us_retire_old(U64Store *s)
{
    table_retire(&s->drain, s->old.table, s->old.table_bytes);
    s->old = (U64Slots){NULL, NULL, 0, 0, NULL, 0};
}

static void
us_step(U64Store *s, Py_ssize_t budget)
{
    U64Slots *old = &s->old;
    pace_run(&s->drain, 1, 0);
    if (old->table == NULL) {
        pace_run(&s->fill, 0, 0);
        return;
    }
    if (old->size == 0) { /* emptied by deletes (us_remove retires it; this is the backstop) */
        us_retire_old(s);
        return;
    }
    /* one pass over the old slots finds every entry left: a walk never takes more */
    if (budget > old->capacity)
        budget = old->capacity;
    Py_ssize_t c = s->cursor; /* the slots below c are next */
    while (budget > 0) {
        if (c == 0)
            c = old->capacity;
        /* slots [lo, c) of the bitmap word of slot c - 1, entries highest first: each is then
         * the last of its run */
        Py_ssize_t base = (c - 1) & ~(Py_ssize_t)63, lo = c - budget > base ? c - budget : base;
        uint64_t bits = old->used[base >> 6];
        if (c - base < 64)
            bits &= (1ULL << (c - base)) - 1;
        bits &= ~((1ULL << (lo - base)) - 1);
        while (bits) {
            int b = 63 - __builtin_clzll(bits);
            bits &= ~(1ULL << b);
            old->used[base >> 6] &= ~(1ULL << b);
            t_insert(&s->cur, T_KEY(old, base + b), T_VAL(old, base + b));
            if (--old->size == 0) {
                us_retire_old(s);
                return;
            }
        }
        budget -= c - lo;
        c = lo;
    }
    s->cursor = c;
}

/* an insert's or delete's step, when there is one to take (inline: most have none) */
static inline void
us_tick(U64Store *s)
{
    if (s->old.table != NULL || s->fill.base != NULL || s->drain.base != NULL)
        us_step(s, MIGRATE_SLOTS);
}

static inline Py_ssize_t
us_next_capacity(const U64Store *s)
{
    return s->sparse ? s->cur.capacity * 2 : s->cur.capacity + s->cur.capacity / 2;
}

/* Start growing: cur becomes the old array of a migration into `next` (mapped now if it was not
 * yet, and populated whatever of it is not yet), 1.5 (sparse: 2) times its size. 0, or -1
 * (MemoryError, nothing changed). */
static int
us_grow(U64Store *s)
{
    /* Steps keep pace with inserts (MIGRATE_SLOTS), so a migration is over before the next
     * growth; were one not, it would end here, all at once. */
    us_step(s, PY_SSIZE_T_MAX);
    if (s->old.table != NULL) /* that pass visited every old slot: none holds an entry now */
        us_retire_old(s);
    if (s->next.table == NULL && t_alloc(&s->next, us_next_capacity(s), 0) < 0)
        return -1;
    pace_run(&s->fill, 0, 1); /* done already when mapped ahead */
    s->old = s->cur;
    s->cur = s->next;
    s->next = (U64Slots){NULL, NULL, 0, 0, NULL, 0};
    Py_ssize_t e = s->old.capacity - 1; /* the walk starts below a free slot (the load is < 1) */
    while (t_used(&s->old, e))
        e--;
    s->cursor = e;
    if (s->old.size == 0)
        t_free(&s->old);
    return 0;
}

/* us_make_room past the load that maps the next array ahead */
static int
us_make_room_slow(U64Store *s, Py_ssize_t n)
{
    Py_ssize_t cap = s->cur.capacity;
    Py_ssize_t grows_at = s->sparse ? cap / 2 + 1 : cap * 4 / 5 + 1; /* the first n that grows it */
    if (n >= grows_at)
        return us_grow(s);
    if (s->next.table == NULL && s->old.table == NULL) {
        Py_ssize_t next = us_next_capacity(s);
        if (((size_t)next * 2 + ((size_t)next + 63) / 64) * sizeof(uint64_t) >= TABLE_MMAP_BYTES) {
            if (t_alloc(&s->next, next, 0) < 0)
                PyErr_Clear(); /* no error: the growth tries again */
            else
                pace_start(&s->fill, s->next.table, s->next.table_bytes, fill_step(s->next.table_bytes, grows_at - n));
        }
    }
    return 0;
}

/* Room for `n` entries: 0, or -1 (MemoryError, nothing changed). Past the load that maps the
 * next array ahead, that is done (it failing is no error: the growth tries again). */
static inline int
us_make_room(U64Store *s, Py_ssize_t n)
{
    Py_ssize_t cap = s->cur.capacity;
    if (s->sparse ? n * 20 > cap * 9 : n * 4 > cap * 3)
        return us_make_room_slow(s, n);
    return 0;
}

/* room for one more entry: 0, or -1 (MemoryError, nothing changed) */
static inline int
us_reserve(U64Store *s)
{
    return us_make_room(s, us_len(s) + 1);
}

/* the value of `key`, or NULL: read where it is, cur or old */
static inline uint64_t *
us_find(const U64Store *s, uint64_t key)
{
    Py_ssize_t i = t_find(&s->cur, key);
    if (i >= 0)
        return &T_VAL(&s->cur, i);
    if (s->old.table != NULL && (i = t_find(&s->old, key)) >= 0)
        return &T_VAL(&s->old, i);
    return NULL;
}

/* `key` (known absent) -> value, after us_reserve made room */
static void
us_add(U64Store *s, uint64_t key, uint64_t value)
{
    t_insert(&s->cur, key, value);
    us_tick(s);
}

/* s[key] = value, in one probe run of cur (and one of old while growing); 0, or -1 (MemoryError,
 * nothing changed) */
static int
us_set(U64Store *s, uint64_t key, uint64_t value)
{
    Py_ssize_t at = t_probe(&s->cur, key);
    if (at >= 0) {
        T_VAL(&s->cur, at) = value;
        return 0;
    }
    if (s->old.table != NULL) {
        Py_ssize_t i = t_find(&s->old, key);
        if (i >= 0) {
            T_VAL(&s->old, i) = value;
            return 0;
        }
    }
    Py_ssize_t cap = s->cur.capacity;
    if (us_make_room(s, us_len(s) + 1) < 0)
        return -1;
    if (s->cur.capacity != cap) /* it grew: the free slot found moved */
        us_add(s, key, value);
    else {
        t_place(&s->cur, ~at, key, value);
        us_tick(s);
    }
    return 0;
}

/* `key` out, its value into *value (if not NULL): 1, or 0 when absent */
static int
us_remove(U64Store *s, uint64_t key, uint64_t *value)
{
    U64Slots *a = &s->cur;
    Py_ssize_t i = t_find(a, key);
    if (i < 0 && s->old.table != NULL) {
        a = &s->old;
        i = t_find(a, key);
    }
    if (i < 0)
        return 0;
    if (value != NULL)
        *value = T_VAL(a, i);
    t_erase(a, i);
    if (a == &s->old && a->size == 0)
        us_retire_old(s); /* its last entry deleted before the walk reached it: the migration is over */
    us_tick(s);
    return 1;
}

/* the bytes the store holds: its arrays, next's populated part, what is left of a drained mapping */
static size_t
us_bytes(const U64Store *s)
{
    size_t next = s->next.table == NULL ? 0 : s->fill.base != NULL ? s->fill.done : s->next.table_bytes;
    return s->cur.table_bytes + s->old.table_bytes + next + pace_left(&s->drain);
}

/* empty, back to the minimum size: 0, or -1 (MemoryError, nothing changed) */
static int
us_reset(U64Store *s)
{
    U64Slots empty;
    if (t_alloc(&empty, TABLE_MIN_CAPACITY, 0) < 0)
        return -1;
    us_free(s);
    s->cur = empty;
    return 0;
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

/* Keys as given to store_chain / map_pairs: a list or tuple of ints, or a buffer of native uint64s
 * (array('Q'), what Router.apply hashes a stored chain into: no int object per key). */
typedef struct {
    Py_buffer view; /* view.obj != NULL: the keys are view.buf */
    PyObject *seq;  /* else a list or tuple (a new reference) */
    Py_ssize_t n;
} U64Keys;

/* 0, or -1 (TypeError when `obj` is no sequence) */
static int
u64_keys_open(PyObject *obj, U64Keys *keys, const char *what)
{
    keys->view.obj = NULL;
    keys->seq = NULL;
    if (!PyList_CheckExact(obj) && !PyTuple_CheckExact(obj) && PyObject_CheckBuffer(obj)) {
        if (PyObject_GetBuffer(obj, &keys->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        const char *fmt = keys->view.format ? keys->view.format : "B";
        if (keys->view.ndim == 1 && keys->view.itemsize == 8 && (strcmp(fmt, "Q") == 0 || strcmp(fmt, "L") == 0)) {
            keys->n = keys->view.len / 8;
            return 0; /* holding the view also keeps an array from being resized meanwhile */
        }
        PyBuffer_Release(&keys->view);
        keys->view.obj = NULL;
        PyErr_Format(PyExc_TypeError, "%s in a buffer are native uint64s (array('Q'))", what);
        return -1;
    }
    keys->seq = PySequence_Fast(obj, "keys must be a sequence");
    if (keys->seq == NULL)
        return -1;
    keys->n = PySequence_Fast_GET_SIZE(keys->seq);
    return 0;
}

/* keys[i] as a uint64 (OverflowError outside [0, 2**64)); 0 or -1 */
static inline int
u64_keys_get(const U64Keys *keys, Py_ssize_t i, uint64_t *out)
{
    if (keys->view.obj != NULL) {
        *out = ((const uint64_t *)keys->view.buf)[i];
        return 0;
    }
    return t_key_strict(PySequence_Fast_GET_ITEM(keys->seq, i), out);
}

static void
u64_keys_close(U64Keys *keys)
{
    if (keys->view.obj != NULL)
        PyBuffer_Release(&keys->view);
    Py_CLEAR(keys->seq);
}

static PyObject *
U64Map_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    /* U64Map(expected=0): room for `expected` entries before the table first grows, populated
     * now. A map filled from a known count in parts between turns of the loop (the reverse
     * engine-hash map of EvictHint and ExportIndex) then neither migrates nor faults pages in
     * inside its parts (issue #16 item 1). */
    static char *kwlist[] = {"expected", NULL};
    Py_ssize_t expected = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n:U64Map", kwlist, &expected))
        return NULL;
    /* a slot takes 16 bytes and there are 1.25 per entry: past this the byte count would wrap */
    if (expected < 0 || expected > PY_SSIZE_T_MAX / 32) {
        PyErr_SetString(PyExc_ValueError, "U64Map(expected): expected must be >= 0 and fit in memory");
        return NULL;
    }
    /* us_set grows the table when an entry would take its load past 0.8 */
    Py_ssize_t capacity = expected + expected / 4 + 1;
    if (capacity < TABLE_MIN_CAPACITY)
        capacity = TABLE_MIN_CAPACITY;
    U64Table *t = (U64Table *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    if (us_init(&t->s, capacity, 0, 1) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void
U64Map_dealloc(U64Table *t)
{
    us_free(&t->s);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t
U64Map_len(U64Table *t)
{
    return us_len(&t->s);
}

/* the value of `keyobj`, NULL if absent (or not a possible key); -1 in *err on error */
static uint64_t *
t_lookup(U64Table *t, PyObject *keyobj, int *err)
{
    uint64_t key;
    int r = t_key(keyobj, &key);
    *err = r < 0;
    return r == 0 ? us_find(&t->s, key) : NULL;
}

static PyObject *
U64Map_subscript(U64Table *t, PyObject *keyobj)
{
    int err;
    uint64_t *value = t_lookup(t, keyobj, &err);
    if (value != NULL)
        return PyLong_FromUnsignedLongLong(*value);
    if (!err)
        PyErr_SetObject(PyExc_KeyError, keyobj);
    return NULL;
}

static int
U64Map_ass_subscript(U64Table *t, PyObject *keyobj, PyObject *valueobj)
{
    uint64_t key;
    if (valueobj == NULL) {
        int r = t_key(keyobj, &key);
        if (r < 0)
            return -1;
        if (r == 1 || !us_remove(&t->s, key, NULL)) {
            PyErr_SetObject(PyExc_KeyError, keyobj);
            return -1;
        }
        return 0;
    }
    uint64_t value;
    if (t_key_strict(keyobj, &key) < 0 || t_key_strict(valueobj, &value) < 0)
        return -1;
    return us_set(&t->s, key, value);
}

static int
U64Map_contains(U64Table *t, PyObject *keyobj)
{
    int err;
    uint64_t *value = t_lookup(t, keyobj, &err);
    return err ? -1 : value != NULL;
}

/* get(key, default=None) */
static PyObject *
U64Map_get(U64Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    int err;
    uint64_t *value = t_lookup(t, args[0], &err);
    if (err)
        return NULL;
    if (value != NULL)
        return PyLong_FromUnsignedLongLong(*value);
    return Py_NewRef(nargs == 2 ? args[1] : Py_None);
}

/* pop(key[, default]) */
static PyObject *
U64Map_pop(U64Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    uint64_t key;
    int r = t_key(args[0], &key);
    if (r < 0)
        return NULL;
    uint64_t *found = r == 0 ? us_find(&t->s, key) : NULL;
    if (found != NULL) {
        PyObject *value = PyLong_FromUnsignedLongLong(*found); /* first: a MemoryError changes nothing */
        if (value != NULL)
            us_remove(&t->s, key, NULL);
        return value;
    }
    if (nargs == 2)
        return Py_NewRef(args[1]);
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyObject *
U64Map_clear(U64Table *t, PyObject *unused)
{
    if (us_reset(&t->s) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* every (key, value) pair into dst (room for us_len(s) pairs), cur's in slot order, then old's */
static void
us_copy_pairs(const U64Store *s, uint64_t *dst)
{
    const U64Slots *arrays[2] = {&s->cur, &s->old};
    Py_ssize_t n = 0;
    for (int k = 0; k < 2; k++) {
        const U64Slots *a = arrays[k];
        Py_ssize_t end = n + a->size;
        for (Py_ssize_t i = 0; i < a->capacity && n < end; i++) {
            if (!t_used(a, i))
                continue;
            dst[2 * n] = T_KEY(a, i);
            dst[2 * n + 1] = T_VAL(a, i);
            n++;
        }
    }
}

/* a list of keys (which = 0), values (1) or (key, value) tuples (2), in slot order */
static PyObject *
t_list(U64Table *t, int which)
{
    /* Snapshot the entries first: building the int objects allocates, and a collection's
     * finalizers could change the map meanwhile. */
    Py_ssize_t n = us_len(&t->s);
    uint64_t *snap = PyMem_Malloc((size_t)(n ? n : 1) * 2 * sizeof(uint64_t));
    if (snap == NULL)
        return PyErr_NoMemory();
    us_copy_pairs(&t->s, snap);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *item = NULL;
        if (out != NULL) {
            PyObject *key = which == 1 ? NULL : PyLong_FromUnsignedLongLong(snap[2 * k]);
            PyObject *value = NULL;
            if (which != 0)
                value = PyLong_FromUnsignedLongLong(snap[2 * k + 1]);
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
    }
    PyMem_Free(snap);
    return out;
}

/* packed_items() -> bytes: every (key, value) pair as two native-endian uint64s, in one C call
 * that makes no int object (a 400k-entry map: ~6 MB copied). Python reads the pairs a few
 * thousand at a time between turns of the event loop (memoryview.cast("Q")), where items()
 * made 800k int objects in one call (issue #16: EvictHint and ExportIndex on a large worker). */
static PyObject *
U64Map_packed_items(U64Table *t, PyObject *unused)
{
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(2 * sizeof(uint64_t)) * us_len(&t->s));
    if (out == NULL)
        return NULL;
    us_copy_pairs(&t->s, (uint64_t *)PyBytes_AS_STRING(out));
    return out;
}

static PyObject *U64Map_keys(U64Table *t, PyObject *unused) { return t_list(t, 0); }
static PyObject *U64Map_values(U64Table *t, PyObject *unused) { return t_list(t, 1); }
static PyObject *U64Map_items(U64Table *t, PyObject *unused) { return t_list(t, 2); }

static PyObject *
U64Map_iter(U64Table *t)
{
    PyObject *keys = t_list(t, 0);
    if (keys == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *
U64Map_sizeof(U64Table *t, PyObject *unused)
{
    return PyLong_FromSize_t(sizeof(U64Table) + us_bytes(&t->s));
}

/* growth_pending: entries still in the array a growth is moving out of (0 when not growing) */
static PyObject *
U64Map_growth_pending(U64Table *t, void *unused)
{
    return PyLong_FromSsize_t(t->s.old.size);
}

/* map_pairs(sources, targets) -> int: self[s] = t for each pair of the two sequences where
 * s != t (an engine hash that is the block key itself needs no entry); returns how many were
 * set. Each is a list or tuple of ints or an array('Q') (read in place). Both are validated
 * before anything changes. The per-block loop of Router.apply's engine-hash bookkeeping. */
/* t[src[i]] = dst[i] for each i < n where the two differ, the slots probed STORE_AHEAD pairs
 * ahead: how many were set, or -1 (MemoryError) */
static Py_ssize_t
map_u64s(U64Table *t, const uint64_t *src, const uint64_t *dst, Py_ssize_t n)
{
    Py_ssize_t set = 0;
    for (Py_ssize_t i = 0; i < n && i < STORE_AHEAD; i++)
        us_prefetch(&t->s, src[i]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + STORE_AHEAD < n)
            us_prefetch(&t->s, src[i + STORE_AHEAD]);
        if (src[i] == dst[i])
            continue;
        if (us_set(&t->s, src[i], dst[i]) < 0)
            return -1;
        set++;
    }
    return set;
}

/* map_pairs' loop over the two open sequences (zip()'s length): how many were set, or -1 */
static Py_ssize_t
map_pairs_run(U64Table *t, const U64Keys *src, const U64Keys *dst)
{
    Py_ssize_t n = src->n < dst->n ? src->n : dst->n; /* as zip() */
    uint64_t *both = PyMem_Malloc(sizeof(uint64_t) * 2 * (size_t)(n ? n : 1));
    Py_ssize_t set = -1;
    if (both == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (u64_keys_get(src, i, &both[i]) < 0 || u64_keys_get(dst, i, &both[n + i]) < 0)
            goto done;
    set = map_u64s(t, both, both + n, n);
done:
    PyMem_Free(both);
    return set;
}

static PyObject *
U64Map_map_pairs(U64Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "map_pairs(sources, targets)");
        return NULL;
    }
    U64Keys src, dst;
    if (u64_keys_open(args[0], &src, "sources") < 0)
        return NULL;
    if (u64_keys_open(args[1], &dst, "targets") < 0) {
        u64_keys_close(&src);
        return NULL;
    }
    Py_ssize_t set = map_pairs_run(t, &src, &dst);
    u64_keys_close(&src);
    u64_keys_close(&dst);
    return set < 0 ? NULL : PyLong_FromSsize_t(set);
}

static PyGetSetDef U64Map_getset[] = {
    {"growth_pending", (getter)U64Map_growth_pending, NULL,
     "entries still to move out of the smaller array while the table grows (0: not growing)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef U64Map_methods[] = {
    {"get", (PyCFunction)(void (*)(void))U64Map_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))U64Map_pop, METH_FASTCALL, "pop(key[, default])"},
    {"clear", (PyCFunction)U64Map_clear, METH_NOARGS, "remove every entry and release the table"},
    {"keys", (PyCFunction)U64Map_keys, METH_NOARGS, "a list of the keys"},
    {"values", (PyCFunction)U64Map_values, METH_NOARGS, "a list of the values"},
    {"items", (PyCFunction)U64Map_items, METH_NOARGS, "a list of (key, value) pairs"},
    {"packed_items", (PyCFunction)U64Map_packed_items, METH_NOARGS,
     "bytes of every (key, value) pair as two native uint64s"},
    {"__sizeof__", (PyCFunction)U64Map_sizeof, METH_NOARGS, "bytes used, tables included"},
    {"map_pairs", (PyCFunction)(void (*)(void))U64Map_map_pairs, METH_FASTCALL,
     "map_pairs(sources, targets) -> int: self[s] = t for each pair with s != t; how many were set"},
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
    .tp_doc = "U64Map(expected=0): a compact dict of uint64 -> uint64 (keys and values 0 <= x < 2**64), "
               "with room for `expected` entries before its table first grows.",
    .tp_basicsize = sizeof(U64Table),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = U64Map_new,
    .tp_dealloc = (destructor)U64Map_dealloc,
    .tp_as_mapping = &U64Map_as_mapping,
    .tp_as_sequence = &U64Map_as_sequence,
    .tp_iter = (getiterfunc)U64Map_iter,
    .tp_methods = U64Map_methods,
    .tp_getset = U64Map_getset,
};

/* ---- Block: one node of RadixIndex ----------------------------------------------------------
 *
 * The pure-Python Block of radix.py with the same attributes and methods, in 48 bytes where the
 * Python class takes 80 plus a 48-byte int for its key:
 *
 * - the key is a uint64 inline (an int object is made only when Python code reads it);
 * - a Block is not a cycle-collector object (that header is 16 bytes, and with a million tracked
 *   blocks full collections were half of all ingest time). Its only reference cycles, parent <->
 *   children, are broken explicitly instead: RadixIndex prunes a block it drops (parent = None),
 *   and a BlockTable unlinks the blocks it holds when it is cleared or released;
 * - holders, last_access and hits live in a BlockState that the blocks of one stored run share
 *   (they are stored together: same holder, same time, no hits) until one of them changes,
 *   which gives that block a state of its own (copy on write; a state only this block refers
 *   to is changed in place). A state is never handed to Python code, so its reference count is
 *   exactly the number of blocks sharing it, and one holding dicts (a block several workers
 *   hold) is never shared: dicts are only ever set through a block's own state.
 *
 * The C code here relies on `parent` being None or a Block, `children` None, a Block or a dict,
 * and `holders` an int, so the setters refuse anything else. */
typedef struct {
    PyObject_HEAD
    PyObject *holders;     /* int bitmask over worker slots */
    PyObject *last_access; /* float, or dict slot -> float */
    PyObject *hits;        /* int, or dict slot -> int */
} BlockState;

typedef struct {
    PyObject_HEAD
    uint64_t key;
    PyObject *parent;   /* None or a Block */
    PyObject *children; /* None, a Block, or a dict key -> Block */
    BlockState *state;  /* never NULL */
} BlockObject;

#ifndef Py_TRACE_REFS
_Static_assert(sizeof(BlockObject) == 48, "a Block fills pymalloc's 48-byte size class exactly");
#endif

static PyTypeObject BlockType, BlockStateType;
static BlockState *state_zero; /* holders 0, last_access 0.0, hits 0: Block(key, parent)'s */
#define IS_BLOCK(o) Py_IS_TYPE((o), &BlockType)
#define BLOCK(o) ((BlockObject *)(o))

/* a new state holding new references to the three values */
static BlockState *
state_new(PyObject *holders, PyObject *last_access, PyObject *hits)
{
    BlockState *st = PyObject_New(BlockState, &BlockStateType); /* not a GC allocation */
    if (st == NULL)
        return NULL;
    st->holders = Py_NewRef(holders);
    st->last_access = Py_NewRef(last_access);
    st->hits = Py_NewRef(hits);
    return st;
}

static void
BlockState_dealloc(BlockState *st)
{
    Py_CLEAR(st->holders);
    Py_CLEAR(st->last_access);
    Py_CLEAR(st->hits);
    PyObject_Free(st);
}

static PyTypeObject BlockStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvrouterd.index._native._BlockState",
    .tp_doc = "holders, last_access and hits of the Blocks sharing it (internal).",
    .tp_basicsize = sizeof(BlockState),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)BlockState_dealloc,
};

/* b's state, made its own first if other blocks share it; NULL on error */
static BlockState *
block_own_state(BlockObject *b)
{
    BlockState *st = b->state;
    if (Py_REFCNT(st) == 1)
        return st;
    BlockState *own = state_new(st->holders, st->last_access, st->hits);
    if (own != NULL)
        Py_SETREF(b->state, own);
    return own;
}

/* a Block under `parent` (borrowed: None or a Block) with the state `st` (borrowed) */
static BlockObject *
block_alloc(uint64_t key, PyObject *parent, BlockState *st)
{
    BlockObject *b = PyObject_New(BlockObject, &BlockType); /* not a GC allocation: runs no collection */
    if (b == NULL)
        return NULL;
    b->key = key;
    b->parent = Py_NewRef(parent);
    b->children = Py_NewRef(Py_None);
    b->state = (BlockState *)Py_NewRef(st);
    return b;
}

static PyObject *
Block_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"key", "parent", NULL};
    PyObject *keyobj, *parent;
    uint64_t key;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:Block", kwlist, &keyobj, &parent) || t_key_strict(keyobj, &key) < 0)
        return NULL;
    if (parent != Py_None && !IS_BLOCK(parent)) {
        PyErr_SetString(PyExc_TypeError, "a Block's parent is None or a Block");
        return NULL;
    }
    return (PyObject *)block_alloc(key, parent, state_zero);
}

static void
Block_dealloc(BlockObject *b)
{
    /* A detached chain owned only by its last block is freed parent after parent in this loop,
     * not by recursion: a long chain must not exhaust the C stack. */
    for (;;) {
        PyObject *parent = b->parent;
        Py_CLEAR(b->children);
        Py_CLEAR(b->state);
        PyObject_Free(b);
        if (parent == NULL)
            return;
        if (!IS_BLOCK(parent) || Py_REFCNT(parent) != 1) {
            Py_DECREF(parent);
            return;
        }
        b = BLOCK(parent); /* its last reference was ours: free it next */
    }
}

static PyObject *
Block_get_link(BlockObject *b, void *children)
{
    return Py_NewRef(children ? b->children : b->parent);
}

static int
Block_set_link(BlockObject *b, PyObject *value, void *children)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "a Block's attributes cannot be deleted");
        return -1;
    }
    if (value != Py_None && !IS_BLOCK(value) && !(children && PyDict_CheckExact(value))) {
        PyErr_SetString(PyExc_TypeError, children ? "a Block's children are None, a Block or a dict"
                                                  : "a Block's parent is None or a Block");
        return -1;
    }
    Py_SETREF(*(children ? &b->children : &b->parent), Py_NewRef(value));
    return 0;
}

#define STATE_FIELD(st, offset) (*(PyObject **)((char *)(st) + (size_t)(offset)))

static PyObject *
Block_get_stat(BlockObject *b, void *offset)
{
    return Py_NewRef(STATE_FIELD(b->state, offset));
}

static int
Block_set_stat(BlockObject *b, PyObject *value, void *offset)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "a Block's attributes cannot be deleted");
        return -1;
    }
    if ((size_t)offset == offsetof(BlockState, holders) && !PyLong_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "a Block's holders are an int");
        return -1;
    }
    BlockState *st = block_own_state(b);
    if (st == NULL)
        return -1;
    Py_SETREF(STATE_FIELD(st, offset), Py_NewRef(value));
    return 0;
}

static PyObject *
Block_get_key(BlockObject *b, void *unused)
{
    return PyLong_FromUnsignedLongLong(b->key);
}

#define BLOCK_STAT(name, doc) \
    {#name, (getter)Block_get_stat, (setter)Block_set_stat, doc, (void *)offsetof(BlockState, name)}

static PyGetSetDef Block_getset[] = {
    {"key", (getter)Block_get_key, NULL, "the block's chained hash (read-only)", NULL},
    {"parent", (getter)Block_get_link, (setter)Block_set_link, "the parent Block, or None at the root", NULL},
    {"children", (getter)Block_get_link, (setter)Block_set_link, "None, the single child Block, or a dict key -> Block",
     (void *)1},
    BLOCK_STAT(holders, "bitmask of the worker slots holding the block"),
    BLOCK_STAT(last_access, "last access time while one slot holds it, else a dict slot -> time"),
    BLOCK_STAT(hits, "hits while one slot holds it, else a dict slot -> hits"),
    {NULL},
};

static PyObject *
Block_iter_children(BlockObject *b, PyObject *unused)
{
    PyObject *c = b->children;
    PyObject *seq;
    if (PyDict_CheckExact(c))
        seq = PyObject_CallMethod(c, "values", NULL); /* a live view, as radix.py's iter(c.values()) */
    else if (c == Py_None)
        seq = PyTuple_New(0);
    else
        seq = PyTuple_Pack(1, c);
    if (seq == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(seq);
    Py_DECREF(seq);
    return it;
}

static PyObject *
Block_depth(BlockObject *b, PyObject *unused)
{
    Py_ssize_t d = 0;
    for (PyObject *node = (PyObject *)b; IS_BLOCK(node); node = BLOCK(node)->parent)
        d++;
    return PyLong_FromSsize_t(d);
}

static PyObject *
Block_repr(BlockObject *b)
{
    PyObject *bits = PyNumber_ToBase(b->state->holders, 2);
    if (bits == NULL)
        return NULL;
    char key[32];
    snprintf(key, sizeof key, "0x%llx", (unsigned long long)b->key);
    PyObject *r = PyUnicode_FromFormat("Block(%s, holders=%U)", key, bits);
    Py_DECREF(bits);
    return r;
}

static PyMethodDef Block_methods[] = {
    {"iter_children", (PyCFunction)Block_iter_children, METH_NOARGS, "an iterator over the child Blocks"},
    {"depth", (PyCFunction)Block_depth, METH_NOARGS, "blocks from the root to this one, inclusive (block 0 has depth 1)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvrouterd.index._native.Block",
    .tp_doc = "Block(key, parent): one cached block of RadixIndex (radix.py's Block, in 48 bytes).",
    .tp_basicsize = sizeof(BlockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Block_new,
    .tp_dealloc = (destructor)Block_dealloc,
    .tp_repr = (reprfunc)Block_repr,
    .tp_getset = Block_getset,
    .tp_methods = Block_methods,
};

/* ---- BlockTable: RadixIndex's key -> Block map -----------------------------------------------
 *
 * Open addressing like U64Map, but a slot is one word, the Block's address, since the key is in
 * the Block: ~12 bytes a block at the same loads (0.53-0.8) instead of ~24. Addresses use 48 bits
 * (x86-64 and arm64 user space), so the other 16 hold a tag from the key's hash: a probe
 * compares the tag and reads a Block's key only when they agree (once in 65,536 otherwise), so
 * a lookup still touches one cache line of the table per probe run, plus the Block it finds.
 * 0 is a free slot. The table owns a reference to every Block in it, and a Block is kept under
 * its own key only. It grows incrementally as U64Store does (above): at 4M blocks one growth
 * re-inserted ~3.5M Blocks, each one's key a cache miss, inside a single stored event.
 *
 * Unlike U64Store it never holds two whole arrays in memory (issue #30 item 4: at 4M blocks the
 * next array, mapped and populated ahead, and the current one were 25 bytes a block beside the
 * Block's 48, 75 in all). A slot's home is monotonic in the key's hash (home_of_mixed), so the
 * migration, walking the old array down, fills the new one from its top down, and a new array
 * is mapped at the growth and faulted in page by page as it fills. The old array is released as
 * the walk leaves it (MADV_DONTNEED: what is left below reads as before, what is released reads
 * as free slots), and a block whose home in the old array the walk has not reached goes into the
 * old array, which the walk then moves, so the new array's low pages are not touched before the
 * walk gets there. Memory thus passes from the old array's bytes to the new one's without holding
 * both: at most 8 bytes per slot of the larger, 15 a block past a growth (1.5 x at load 0.8). */
typedef struct {
    uint64_t *slots; /* NULL: no array */
    Py_ssize_t capacity;
    Py_ssize_t size;
    size_t table_bytes;
} BTSlots;

typedef struct {
    PyObject_HEAD
    BTSlots cur;       /* where new blocks go */
    BTSlots old;       /* while growing: the smaller array being emptied into cur (else slots NULL) */
    Py_ssize_t cursor; /* the old slot the migration looked at last; it goes on below it */
    Py_ssize_t top;    /* the free old slot the migration started below: slots [cursor, top] are empty */
    int wrapped;       /* the walk passed slot 0 and goes on from the old array's end down to `top` */
    size_t released;   /* old's bytes from here up to `top` are released (a page boundary; 0: none) */
    TablePace drain;   /* an emptied old array's mapping, being unmapped */
} BlockTable;

static PyTypeObject BlockTableType;

#define BT_ADDR_MASK ((1ULL << 48) - 1)
#define BT_BLOCK(e) ((BlockObject *)(uintptr_t)((e) & BT_ADDR_MASK))
/* the tag: the low 16 bits of the mixed key (the slot comes from its high bits) */
#define BT_TAG(mixed) ((mixed) << 48)

static inline Py_ssize_t
home_of_mixed(uint64_t mixed, Py_ssize_t capacity)
{
    return (Py_ssize_t)(((unsigned __int128)mixed * (uint64_t)capacity) >> 64);
}

/* `a` an empty array of `capacity` slots; 0, or -1 (MemoryError, `a` untouched) */
static int
bt_alloc(BTSlots *a, Py_ssize_t capacity)
{
    size_t bytes = (size_t)capacity * sizeof(uint64_t);
    uint64_t *slots = table_alloc(bytes, 0);
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    a->slots = slots;
    a->table_bytes = bytes;
    a->capacity = capacity;
    a->size = 0;
    return 0;
}

static void
bt_free(BTSlots *a)
{
    table_free(a->slots, a->table_bytes);
    *a = (BTSlots){NULL, 0, 0, 0};
}

static inline Py_ssize_t
bt_len(const BlockTable *t)
{
    return t->cur.size + t->old.size;
}

/* The slot of `key` (u64_mix(key) is `mixed`), or, when it is absent, ~f (negative) for the free
 * slot f that ended the search, where `key` goes (as t_probe: one run for a miss and its insert) */
static inline Py_ssize_t
bt_probe(const BTSlots *a, uint64_t key, uint64_t mixed)
{
    uint64_t tag = BT_TAG(mixed);
    Py_ssize_t i = home_of_mixed(mixed, a->capacity);
    for (;;) {
        uint64_t e = a->slots[i];
        if (e == 0)
            return ~i;
        if ((e & ~BT_ADDR_MASK) == tag && BT_BLOCK(e)->key == key)
            return i;
        if (++i == a->capacity)
            i = 0;
    }
}

/* the slot holding `key`, in cur or (while growing) old, or NULL */
static inline uint64_t *
bt_find(const BlockTable *t, uint64_t key)
{
    uint64_t mixed = u64_mix(key);
    Py_ssize_t i = bt_probe(&t->cur, key, mixed);
    if (i >= 0)
        return &t->cur.slots[i];
    if (t->old.slots != NULL && (i = bt_probe(&t->old, key, mixed)) >= 0)
        return &t->old.slots[i];
    return NULL;
}

/* the home slot of `key` on its way into cache, in both arrays while the table grows */
PREFETCH_HELPER
bt_prefetch(const BlockTable *t, uint64_t key)
{
    uint64_t mixed = u64_mix(key);
    __builtin_prefetch(&t->cur.slots[home_of_mixed(mixed, t->cur.capacity)]);
    if (t->old.slots != NULL)
        __builtin_prefetch(&t->old.slots[home_of_mixed(mixed, t->old.capacity)]);
}

/* put `b` (its key known absent; u64_mix(key) is `mixed`) into a free slot; the array must have one */
static void
bt_insert(BTSlots *a, BlockObject *b, uint64_t mixed)
{
    Py_ssize_t i = home_of_mixed(mixed, a->capacity);
    while (a->slots[i]) {
        if (++i == a->capacity)
            i = 0;
    }
    a->slots[i] = (uint64_t)(uintptr_t)b | BT_TAG(mixed);
    a->size++;
}

/* How many old slots ahead a migration asks for a Block's key. A table's blocks lie in hash
 * order, so each key it reads is a cache miss of its own (issue #12: the growth was a third of
 * a stored block's misses); asked for this far ahead, they are fetched side by side. */
#define BT_RESIZE_PREFETCH 16

/* The migration's next `budget` old slots, as us_step: going down, each block found is the last
 * of its probe run and moves to cur with no shift; old is freed once empty. */
static void
bt_retire_old(BlockTable *t)
{
    table_retire(&t->drain, t->old.slots, t->old.table_bytes);
    t->old = (BTSlots){NULL, 0, 0, 0};
}

/* Release (MADV_DONTNEED) the old array's pages the walk has emptied, in TABLE_CHUNK steps: every
 * slot of [cursor, top] is free, and a released page reads as zeros, free slots, so a probe that
 * ends there still ends there. Before the walk wraps, and only for a mapped array. */
static void
bt_release_behind(BlockTable *t)
{
    BTSlots *old = &t->old;
    if (t->wrapped || old->table_bytes < TABLE_MMAP_BYTES)
        return;
    size_t page = 4096, lo = ((size_t)t->cursor * sizeof(uint64_t) + page - 1) & ~(page - 1);
    size_t hi = t->released ? t->released : ((size_t)(t->top + 1) * sizeof(uint64_t)) & ~(page - 1);
    if (lo >= hi || hi - lo < TABLE_CHUNK)
        return;
    madvise((char *)old->slots + lo, hi - lo, MADV_DONTNEED);
    t->released = lo;
}

static void
bt_step(BlockTable *t, Py_ssize_t budget)
{
    BTSlots *old = &t->old;
    pace_run(&t->drain, 1, 0);
    if (old->slots == NULL)
        return;
    if (old->size == 0) { /* emptied by deletes (bt_take retires it; this is the backstop) */
        bt_retire_old(t);
        return;
    }
    /* one pass over the old slots finds every block left: a walk never takes more */
    if (budget > old->capacity)
        budget = old->capacity;
    Py_ssize_t c = t->cursor; /* the slots below c are next */
    while (budget > 0) {
        if (c == 0) {
            c = old->capacity;
            t->wrapped = 1;
        }
        Py_ssize_t lo = c > budget ? c - budget : 0;
        for (Py_ssize_t i = c - 1; i >= lo; i--) {
            if (i >= BT_RESIZE_PREFETCH && old->slots[i - BT_RESIZE_PREFETCH])
                __builtin_prefetch(&BT_BLOCK(old->slots[i - BT_RESIZE_PREFETCH])->key);
            uint64_t e = old->slots[i];
            if (e) {
                old->slots[i] = 0;
                BlockObject *b = BT_BLOCK(e);
                bt_insert(&t->cur, b, u64_mix(b->key)); /* the reference moves with the block */
                if (--old->size == 0) {
                    bt_retire_old(t);
                    return;
                }
            }
        }
        budget -= c - lo;
        c = lo;
    }
    t->cursor = c;
    bt_release_behind(t);
}

/* an insert's or delete's step, when there is one to take */
static inline void
bt_tick(BlockTable *t)
{
    if (t->old.slots != NULL || t->drain.base != NULL)
        bt_step(t, MIGRATE_SLOTS);
}

/* Start growing by half, as us_grow: 0, or -1 (MemoryError, nothing changed) */
static int
bt_grow(BlockTable *t)
{
    bt_step(t, PY_SSIZE_T_MAX); /* over already when the steps keep pace (they do: U64Store) */
    if (t->old.slots != NULL) /* that pass visited every old slot: none holds a block now */
        bt_retire_old(t);
    BTSlots next;
    if (bt_alloc(&next, t->cur.capacity + t->cur.capacity / 2) < 0)
        return -1;
    t->old = t->cur;
    t->cur = next;
    Py_ssize_t e = t->old.capacity - 1; /* the walk starts below a free slot (the load is < 1) */
    while (t->old.slots[e])
        e--;
    t->cursor = t->top = e;
    t->wrapped = 0;
    t->released = 0;
    if (t->old.size == 0)
        bt_free(&t->old);
    return 0;
}

/* While growing, the free old slot where a block whose old home the walk has not reached goes
 * (its probe run ends below the cursor, before the walk wraps), so that the walk moves it; else
 * -1: it goes into the new array. */
static inline Py_ssize_t
bt_old_place(const BlockTable *t, uint64_t mixed)
{
    const BTSlots *old = &t->old;
    if (old->slots == NULL || t->wrapped)
        return -1;
    Py_ssize_t i = home_of_mixed(mixed, old->capacity);
    while (i < t->cursor) {
        if (old->slots[i] == 0)
            return i;
        i++;
    }
    return -1;
}

/* `b` (key known absent) goes into the table, which takes over the caller's reference. `at` is
 * bt_probe's answer for the key on cur as it is (~ the free slot), or 0 when not known. */
static int
bt_add_at(BlockTable *t, BlockObject *b, uint64_t mixed, Py_ssize_t at)
{
    if ((uintptr_t)b & ~BT_ADDR_MASK) {
        PyErr_SetString(PyExc_SystemError, "a Block's address does not fit in 48 bits");
        return -1;
    }
    Py_ssize_t n = bt_len(t) + 1, cap = t->cur.capacity;
    if (n >= cap * 4 / 5 + 1) { /* grows by half past load 0.8: the free slot moves */
        if (bt_grow(t) < 0)
            return -1;
        at = 0;
    }
    Py_ssize_t in_old = bt_old_place(t, mixed);
    if (in_old >= 0) {
        t->old.slots[in_old] = (uint64_t)(uintptr_t)b | BT_TAG(mixed);
        t->old.size++;
    }
    else if (at < 0) {
        t->cur.slots[~at] = (uint64_t)(uintptr_t)b | BT_TAG(mixed);
        t->cur.size++;
    }
    else
        bt_insert(&t->cur, b, mixed);
    bt_tick(t);
    return 0;
}

/* `b` (key known absent) goes into the table, which takes over the caller's reference */
static int
bt_add(BlockTable *t, BlockObject *b)
{
    return bt_add_at(t, b, u64_mix(b->key), 0);
}

/* remove the entry in slot i of `a`, shifting later members of its probe run back (no
 * tombstones); returns the removed Block, whose reference passes to the caller */
static BlockObject *
bt_erase(BTSlots *a, Py_ssize_t i)
{
    BlockObject *removed = BT_BLOCK(a->slots[i]);
    Py_ssize_t cap = a->capacity;
    Py_ssize_t j = i;
    for (;;) {
        if (++j == cap)
            j = 0;
        uint64_t e = a->slots[j];
        if (e == 0)
            break;
        Py_ssize_t home = home_of_mixed(u64_mix(BT_BLOCK(e)->key), cap);
        /* entry j may fill the hole at i unless its home lies cyclically in (i, j] */
        int home_in_range = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (home_in_range)
            continue;
        a->slots[i] = e;
        i = j;
    }
    a->slots[i] = 0;
    a->size--;
    return removed;
}

/* the block in `slot` (bt_find's answer) out of the table, its reference passed to the caller */
static BlockObject *
bt_take(BlockTable *t, uint64_t *slot)
{
    BTSlots *a = slot >= t->cur.slots && slot < t->cur.slots + t->cur.capacity ? &t->cur : &t->old;
    BlockObject *removed = bt_erase(a, slot - a->slots);
    if (a == &t->old && a->size == 0)
        bt_retire_old(t); /* its last block taken before the walk reached it: the migration is over */
    bt_tick(t);
    return removed;
}

/* Break the parent <-> children cycles of every block in `a` (each one's parent and children
 * become None): blocks are not collected as cycles, so a released index would leak its tree.
 * The table keeps every block alive meanwhile, so this frees at most children dicts. */
static void
bt_unlink(BTSlots *a)
{
    for (Py_ssize_t i = 0; i < a->capacity; i++) {
        if (!a->slots[i])
            continue;
        BlockObject *b = BT_BLOCK(a->slots[i]);
        PyObject *parent = b->parent, *children = b->children;
        b->parent = Py_NewRef(Py_None);
        b->children = Py_NewRef(Py_None);
        Py_XDECREF(parent);
        Py_XDECREF(children);
    }
}

/* unlink and release every block of the arrays of a table no longer reachable from Python */
static void
bt_release(BTSlots *cur, BTSlots *old)
{
    BTSlots *arrays[2] = {cur, old};
    for (int k = 0; k < 2; k++)
        if (arrays[k]->slots != NULL)
            bt_unlink(arrays[k]);
    for (int k = 0; k < 2; k++) {
        BTSlots *a = arrays[k];
        for (Py_ssize_t i = 0; a->slots != NULL && i < a->capacity; i++)
            if (a->slots[i])
                Py_DECREF(BT_BLOCK(a->slots[i]));
        bt_free(a);
    }
}

static PyObject *
BlockTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_Format(PyExc_TypeError, "%.100s() takes no arguments", type->tp_name);
        return NULL;
    }
    BlockTable *t = (BlockTable *)type->tp_alloc(type, 0); /* zeroed: no old array */
    if (t == NULL)
        return NULL;
    if (bt_alloc(&t->cur, TABLE_MIN_CAPACITY) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void
BlockTable_dealloc(BlockTable *t)
{
    bt_release(&t->cur, &t->old);
    pace_run(&t->drain, 1, 1);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t
BlockTable_len(BlockTable *t)
{
    return bt_len(t);
}

/* the slot of `keyobj`, NULL if absent (or not a possible key); *err set on error */
static uint64_t *
bt_lookup(BlockTable *t, PyObject *keyobj, int *err)
{
    uint64_t key;
    int r = t_key(keyobj, &key);
    *err = r < 0;
    return r == 0 ? bt_find(t, key) : NULL;
}

static PyObject *
BlockTable_subscript(BlockTable *t, PyObject *keyobj)
{
    int err;
    uint64_t *slot = bt_lookup(t, keyobj, &err);
    if (slot != NULL)
        return Py_NewRef(BT_BLOCK(*slot));
    if (!err)
        PyErr_SetObject(PyExc_KeyError, keyobj);
    return NULL;
}

static int
BlockTable_ass_subscript(BlockTable *t, PyObject *keyobj, PyObject *value)
{
    if (value == NULL) {
        int err;
        uint64_t *slot = bt_lookup(t, keyobj, &err);
        if (err)
            return -1;
        if (slot == NULL) {
            PyErr_SetObject(PyExc_KeyError, keyobj);
            return -1;
        }
        Py_DECREF(bt_take(t, slot));
        return 0;
    }
    uint64_t key;
    if (t_key_strict(keyobj, &key) < 0)
        return -1;
    if (!IS_BLOCK(value)) {
        PyErr_Format(PyExc_TypeError, "a BlockTable holds Blocks, not %.100s", Py_TYPE(value)->tp_name);
        return -1;
    }
    if (BLOCK(value)->key != key) {
        PyErr_SetString(PyExc_ValueError, "a Block is kept under its own key");
        return -1;
    }
    uint64_t *slot = bt_find(t, key);
    if (slot != NULL) {
        if ((uintptr_t)value & ~BT_ADDR_MASK) {
            PyErr_SetString(PyExc_SystemError, "a Block's address does not fit in 48 bits");
            return -1;
        }
        BlockObject *old = BT_BLOCK(*slot);
        *slot = (*slot & ~BT_ADDR_MASK) | (uint64_t)(uintptr_t)Py_NewRef(value);
        Py_DECREF(old);
        return 0;
    }
    Py_INCREF(value);
    if (bt_add(t, BLOCK(value)) < 0) {
        Py_DECREF(value);
        return -1;
    }
    return 0;
}

static int
BlockTable_contains(BlockTable *t, PyObject *keyobj)
{
    int err;
    uint64_t *slot = bt_lookup(t, keyobj, &err);
    return err ? -1 : slot != NULL;
}

/* get(key, default=None) */
static PyObject *
BlockTable_get(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    int err;
    uint64_t *slot = bt_lookup(t, args[0], &err);
    if (err)
        return NULL;
    if (slot != NULL)
        return Py_NewRef(BT_BLOCK(*slot));
    return Py_NewRef(nargs == 2 ? args[1] : Py_None);
}

/* pop(key[, default]) */
static PyObject *
BlockTable_pop(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    int err;
    uint64_t *slot = bt_lookup(t, args[0], &err);
    if (err)
        return NULL;
    if (slot != NULL)
        return (PyObject *)bt_take(t, slot);
    if (nargs == 2)
        return Py_NewRef(args[1]);
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyObject *
BlockTable_clear(BlockTable *t, PyObject *unused)
{
    BTSlots cur = t->cur, old = t->old, empty;
    if (bt_alloc(&empty, TABLE_MIN_CAPACITY) < 0)
        return NULL;
    t->cur = empty;
    t->old = (BTSlots){NULL, 0, 0, 0};
    pace_run(&t->drain, 1, 1);
    bt_release(&cur, &old); /* out of the table first: what releasing frees cannot see it half-done */
    Py_RETURN_NONE;
}

/* a list of keys (which = 0), blocks (1) or (key, block) tuples (2): cur's in slot order, then old's */
static PyObject *
bt_list(BlockTable *t, int which)
{
    /* Own the blocks first: building the lists allocates, and a collection's finalizers could
     * change the table meanwhile. */
    Py_ssize_t n = 0, size = bt_len(t);
    BlockObject **snap = PyMem_Malloc((size_t)(size ? size : 1) * sizeof(BlockObject *));
    if (snap == NULL)
        return PyErr_NoMemory();
    const BTSlots *arrays[2] = {&t->cur, &t->old};
    for (int k = 0; k < 2; k++) {
        const BTSlots *a = arrays[k];
        Py_ssize_t end = n + a->size;
        for (Py_ssize_t i = 0; i < a->capacity && n < end; i++)
            if (a->slots[i])
                snap[n++] = (BlockObject *)Py_NewRef(BT_BLOCK(a->slots[i]));
    }
    PyObject *out = PyList_New(n);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (out != NULL) {
            PyObject *item;
            if (which == 1)
                item = Py_NewRef(snap[k]);
            else {
                PyObject *key = PyLong_FromUnsignedLongLong(snap[k]->key);
                item = which == 0 || key == NULL ? Py_XNewRef(key) : PyTuple_Pack(2, key, (PyObject *)snap[k]);
                Py_XDECREF(key);
            }
            if (item == NULL)
                Py_CLEAR(out);
            else
                PyList_SET_ITEM(out, k, item);
        }
        Py_DECREF(snap[k]);
    }
    PyMem_Free(snap);
    return out;
}

static PyObject *BlockTable_keys(BlockTable *t, PyObject *unused) { return bt_list(t, 0); }
static PyObject *BlockTable_values(BlockTable *t, PyObject *unused) { return bt_list(t, 1); }
static PyObject *BlockTable_items(BlockTable *t, PyObject *unused) { return bt_list(t, 2); }

static PyObject *
BlockTable_iter(BlockTable *t)
{
    PyObject *keys = bt_list(t, 0);
    if (keys == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

/* growth_pending: blocks still in the array a growth is moving out of (0 when not growing) */
static PyObject *
BlockTable_growth_pending(BlockTable *t, void *unused)
{
    return PyLong_FromSsize_t(t->old.size);
}

static PyGetSetDef BlockTable_getset[] = {
    {"growth_pending", (getter)BlockTable_growth_pending, NULL,
     "blocks still to move out of the smaller array while the table grows (0: not growing)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *
BlockTable_sizeof(BlockTable *t, PyObject *unused)
{
    size_t released = t->old.slots == NULL || !t->released ? 0 : ((size_t)(t->top + 1) * sizeof(uint64_t) & ~(size_t)4095) - t->released;
    return PyLong_FromSize_t(sizeof(BlockTable) + t->cur.table_bytes + t->old.table_bytes - released + pace_left(&t->drain));
}

/* ---- ints as CPython stores them -------------------------------------------------------------
 *
 * A block's holders are an int bitmask over slots, as wide as its highest holder's slot; the store
 * and the match walk read its digits (PyLong_SHIFT bits each, least significant first) in place
 * (CPython >= 3.11 stores an int so: longintrepr.h, included by Python.h). */

/* The int `v`'s magnitude as CPython stores it: its digit count with the digits in *d, or -1
 * when `v` is negative (the caller intersects those the slow way). */
static inline Py_ssize_t
long_digits(PyObject *v, const digit **d)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyLongObject *l = (PyLongObject *)v;
    uintptr_t tag = l->long_value.lv_tag; /* digits << 3 | sign (0 positive, 1 zero, 2 negative) */
    *d = l->long_value.ob_digit;
    return (tag & 3) == 2 ? -1 : (Py_ssize_t)(tag >> 3);
#else
    Py_ssize_t size = Py_SIZE(v); /* negative for a negative int */
    *d = ((PyLongObject *)v)->ob_digit;
    return size < 0 ? -1 : size;
#endif
}

/* ---- RadixIndex.store's loop ------------------------------------------------------------------
 *
 * BlockTable.store_chain runs RadixIndex.store's Python loop (radix.py) over a stored chain:
 * keys the index lacks become new Blocks (engines report blocks they just computed, so most
 * are), and a key it has, another worker's block or one this worker stored again, gains the
 * worker as a holder or is touched, exactly as the loop does it. Only a block that fills a gap
 * above blocks the worker already holds (whose pending accesses the loop settles first), one
 * nobody holds (the loop counts those: RadixIndex.unheld) or one whose fields are not the
 * shapes the index gives them is left to the Python loop: the call stops
 * there, the loop does that one and calls again. Before, every block another worker held took
 * the Python loop: 8 workers storing 64-block chains with 32-block shared prefixes cost ~6,100
 * instructions a stored block. */

/* parent.children gains `node` (None -> the node, one Block -> {key: block, ...}, dict -> item) */
static int
block_link_child(BlockObject *parent, PyObject *key_obj, BlockObject *node)
{
    PyObject *c = parent->children;
    if (c == Py_None) {
        Py_SETREF(parent->children, Py_NewRef(node));
        return 0;
    }
    if (PyDict_CheckExact(c))
        return PyDict_SetItem(c, key_obj, (PyObject *)node);
    PyObject *both = PyDict_New(), *c_key = PyLong_FromUnsignedLongLong(BLOCK(c)->key);
    if (both == NULL || c_key == NULL || PyDict_SetItem(both, c_key, c) < 0
        || PyDict_SetItem(both, key_obj, (PyObject *)node) < 0) {
        Py_XDECREF(both);
        Py_XDECREF(c_key);
        return -1;
    }
    Py_DECREF(c_key);
    Py_SETREF(parent->children, both);
    return 0;
}

/* A block's holders as the store reads them, in place (long_digits: no int made): how many
 * slots hold it, 0, 1 or 2 for more, and whether `slot` is one; -1 when `holders` is not a
 * non-negative int (the block is left to the Python loop). */
static inline int
holders_read(PyObject *holders, Py_ssize_t slot, int *has)
{
    const digit *d;
    if (!PyLong_CheckExact(holders))
        return -1;
    Py_ssize_t n = long_digits(holders, &d);
    if (n < 0)
        return -1;
    Py_ssize_t at = slot / PyLong_SHIFT;
    *has = at < n && (d[at] >> (slot % PyLong_SHIFT)) & 1;
    if (n == 0)
        return 0;
    for (Py_ssize_t i = 0; i < n - 1; i++) /* CPython keeps no leading zero digit: d[n - 1] != 0 */
        if (d[i])
            return 2;
    return d[n - 1] & (d[n - 1] - 1) ? 2 : 1;
}

/* whether `bit` (1 << slot) is in `holders`: in place for a non-negative int, else as `&` does; -1 on error */
static int
holders_has(PyObject *holders, Py_ssize_t slot, PyObject *bit)
{
    int has;
    if (holders_read(holders, slot, &has) >= 0)
        return has;
    PyObject *held = PyNumber_And(holders, bit);
    int r = held == NULL ? -1 : PyObject_IsTrue(held);
    Py_XDECREF(held);
    return r;
}

/* the highest slot in a positive int's digits (`holders.bit_length() - 1`) */
static inline Py_ssize_t
holders_top(PyObject *holders)
{
    const digit *d;
    Py_ssize_t n = long_digits(holders, &d);
    return (n - 1) * PyLong_SHIFT + (Py_ssize_t)(31 - __builtin_clz(d[n - 1]));
}

/* One RadixIndex.store call's arguments and what it counts */
typedef struct {
    Py_ssize_t slot;
    PyObject *slot_obj; /* the slot as an int: its key in a shared block's stats dicts */
    PyObject *bit;      /* 1 << slot */
    PyObject *now;
    PyObject *leaves;   /* the slot's leaves (a set) */
    PyObject *chain;    /* the list the chain's blocks are appended to */
    PyObject *pending;  /* RadixIndex._pending: Block -> pending accesses */
    PyObject *alone;    /* RadixIndex._alone: bit -> blocks that slot alone holds */
    Py_ssize_t added;   /* blocks the slot holds now that it did not */
    Py_ssize_t alone_n; /* of those, the ones it alone holds */
    BlockState *fresh;  /* the state the last store_run's new blocks share (borrowed), or NULL */
    /* The holders this run last joined the slot to and the int it made of them (both owned, so
     * neither address is reused meanwhile): the next block with that same int takes the same
     * result. A chain whose blocks have the same holders thus keeps one int for all of them,
     * which the match walk passes over without reading (match_walk_table). */
    PyObject *joined_from, *joined;
} StoreRun;

static int held_child(BlockObject *parent, PyObject *bit);

/* `node`, a block the table holds, stored by the slot as RadixIndex.store's loop does it: the
 * slot touches it if it holds it (RadixIndex.touch), else joins its holders with fresh stats
 * (RadixIndex._add_stats, the count of blocks one slot alone holds, the slot's leaves). 1 done;
 * 0 left to the Python loop with nothing changed (a gap above blocks the slot holds, a block
 * nobody holds, or fields not in the shapes the index gives them); -1 on error. `node` is the
 * caller's. */
static int
store_existing(StoreRun *r, BlockObject *node)
{
    PyObject *holders = node->state->holders;
    int has, count = holders_read(holders, r->slot, &has);
    if (count < 0)
        return 0;
    if (has) { /* RadixIndex.touch */
        BlockState *st = node->state;
        if (count == 1) {
            if (!PyLong_CheckExact(st->hits))
                return 0;
            PyObject *hits = PyNumber_Add(st->hits, one);
            if (hits == NULL || (st = block_own_state(node)) == NULL) {
                Py_XDECREF(hits);
                return -1;
            }
            Py_SETREF(st->last_access, Py_NewRef(r->now));
            Py_SETREF(st->hits, hits);
            return 1;
        }
        /* several holders: stats in dicts, which a block never shares (block_own_state) */
        PyObject *la = st->last_access, *hits_of = st->hits;
        if (!PyDict_CheckExact(la) || !PyDict_CheckExact(hits_of))
            return 0;
        PyObject *h = PyDict_GetItemWithError(hits_of, r->slot_obj);
        if (h == NULL || !PyLong_CheckExact(h))
            return PyErr_Occurred() ? -1 : 0;
        Py_INCREF(la);
        Py_INCREF(hits_of);
        PyObject *h1 = PyNumber_Add(h, one);
        int ok = h1 != NULL && PyDict_SetItem(la, r->slot_obj, r->now) == 0 && PyDict_SetItem(hits_of, r->slot_obj, h1) == 0;
        Py_XDECREF(h1);
        Py_DECREF(la);
        Py_DECREF(hits_of);
        return ok ? 1 : -1;
    }
    if (node->children != Py_None) { /* a gap above held blocks: the Python loop settles them */
        int held = held_child(node, r->bit);
        if (held != 0)
            return held < 0 ? -1 : 0;
    }
    /* Check and make everything first, change the block after: nothing below the objects made
     * here can run Python code, so the block is changed whole or not at all. */
    BlockState *st = node->state;
    holders = Py_NewRef(st->holders); /* ours: read again, what held_child ran may have changed it */
    PyObject *la = Py_NewRef(st->last_access), *hits = Py_NewRef(st->hits);
    PyObject *new_la = NULL, *new_hits = NULL, *up = NULL, *new_up = NULL, *alone_left = NULL, *joined = NULL;
    int done = -1;
    count = holders_read(holders, r->slot, &has);
    /* a block nobody holds (a gap an engine's eviction left) is the Python loop's: it counts
     * such blocks (RadixIndex.unheld), which this call does not return */
    if (count <= 0 || has) {
        done = 0;
        goto out;
    }
    if (count == 1) { /* its one holder no longer holds it alone */
        PyObject *n_alone = PyDict_GetItemWithError(r->alone, holders);
        if (n_alone == NULL || !PyLong_CheckExact(n_alone)) {
            done = PyErr_Occurred() ? -1 : 0;
            goto out;
        }
        if ((alone_left = PyNumber_Subtract(n_alone, one)) == NULL)
            goto out;
    }
    if (!PyDict_CheckExact(la)) { /* a second holder: the stats become dicts by slot */
        PyObject *first = PyLong_FromSsize_t(holders_top(holders));
        if (first == NULL)
            goto out;
        if (PyDict_GET_SIZE(r->pending)) {
            up = PyDict_GetItemWithError(r->pending, (PyObject *)node);
            if (up == NULL && PyErr_Occurred()) {
                Py_DECREF(first);
                goto out;
            }
            Py_XINCREF(up);
        }
        new_la = PyDict_New();
        new_hits = PyDict_New();
        new_up = up == NULL ? NULL : PyDict_New();
        int ok = new_la != NULL && new_hits != NULL && (up == NULL || new_up != NULL)
                 && PyDict_SetItem(new_la, first, la) == 0 && PyDict_SetItem(new_hits, first, hits) == 0
                 && (up == NULL || PyDict_SetItem(new_up, first, up) == 0);
        Py_DECREF(first);
        if (!ok)
            goto out;
    }
    else if (!PyDict_CheckExact(hits)) {
        done = 0;
        goto out;
    }
    if (holders == r->joined_from)
        joined = Py_NewRef(r->joined);
    else if ((joined = PyNumber_Or(holders, r->bit)) == NULL)
        goto out;
    if ((st = block_own_state(node)) == NULL)
        goto out;
    /* no failure past here but a dict or set entry's memory */
    if (PySet_Add(r->leaves, (PyObject *)node) < 0)
        goto out;
    if (new_la != NULL) {
        Py_SETREF(st->last_access, Py_NewRef(new_la));
        Py_SETREF(st->hits, Py_NewRef(new_hits));
        if (new_up != NULL && PyDict_SetItem(r->pending, (PyObject *)node, new_up) < 0)
            goto out;
    }
    if (PyDict_SetItem(st->last_access, r->slot_obj, r->now) < 0 || PyDict_SetItem(st->hits, r->slot_obj, zero) < 0)
        goto out;
    if (alone_left != NULL && PyDict_SetItem(r->alone, holders, alone_left) < 0)
        goto out;
    Py_SETREF(st->holders, Py_NewRef(joined));
    Py_XSETREF(r->joined_from, Py_NewRef(holders));
    Py_XSETREF(r->joined, Py_NewRef(joined));
    r->added++;
    /* the block's own parent stops being a leaf: the chain's previous block only when the keys
     * chain (RadixIndex.store's docstring: Route stores keys a client sent, in any order) */
    PyObject *above = node->parent;
    if (above != Py_None) {
        int held = holders_has(BLOCK(above)->state->holders, r->slot, r->bit);
        if (held < 0 || (held && PySet_Discard(r->leaves, above) < 0))
            goto out;
    }
    done = 1;
out:
    Py_DECREF(holders);
    Py_DECREF(la);
    Py_DECREF(hits);
    Py_XDECREF(new_la);
    Py_XDECREF(new_hits);
    Py_XDECREF(up);
    Py_XDECREF(new_up);
    Py_XDECREF(alone_left);
    Py_XDECREF(joined);
    return done;
}

/* RadixIndex.store's loop over `keys` from `i` under `parent` (None or a Block): returns the
 * index of the first key left to the Python loop (keys->n when none), or -1 with an exception.
 *
 * A key the table lacks becomes a Block(key, parent) held by the slot alone (holders = bit,
 * last_access = now, hits = 0), in the table, under `parent`, onto the chain, and the next
 * key's parent. The blocks of one call share one state (copy on write). `leaves` ends as the
 * Python loop leaves it, one block at a time: a run of new blocks' first parent leaves it if the
 * slot holds it, and only the run's last block joins it (each new block is the parent of the
 * next, so every other one joins and leaves again at once). A block the table has takes its
 * own tree parent out, which is the chain's previous block only when the keys chain (Route
 * stores keys a client sent: issue #28 item 2). */
static Py_ssize_t
store_run(BlockTable *t, PyObject *parent, const U64Keys *keys, Py_ssize_t i, StoreRun *r)
{
    BlockState *run = NULL;   /* the state of the blocks made here (made with the first) */
    BlockObject *last = NULL; /* the open run's last block: the one that joins `leaves` */
    /* keys in a buffer are read ahead for free; ints would each be converted twice */
    const uint64_t *ahead = keys->view.obj != NULL ? (const uint64_t *)keys->view.buf : NULL;
    Py_INCREF(parent);        /* ours while Python code (a collection's finalizers) may run */
    for (Py_ssize_t k = i; ahead != NULL && k < keys->n && k < i + STORE_AHEAD; k++)
        bt_prefetch(t, ahead[k]);
    for (; i < keys->n; i++) {
        uint64_t key;
        if (ahead != NULL && i + STORE_AHEAD < keys->n)
            bt_prefetch(t, ahead[i + STORE_AHEAD]);
        if (u64_keys_get(keys, i, &key) < 0)
            goto error;
        uint64_t mixed = u64_mix(key);
        Py_ssize_t at = bt_probe(&t->cur, key, mixed), at_old = -1;
        if (at >= 0 || (t->old.slots != NULL && (at_old = bt_probe(&t->old, key, mixed)) >= 0)) {
            BlockObject *node = BT_BLOCK(at >= 0 ? t->cur.slots[at] : t->old.slots[at_old]);
            Py_INCREF(node);
            /* the open run's last block joins the leaves now, as the loop left it: a block the
             * table has is never its child when the keys chain (it is new), and when they do not
             * (keys a client sent: a repeated key, one under another parent) it stays a leaf
             * unless `node` is its child (store_existing takes `node`'s own parent out) */
            if (last != NULL) {
                if (PySet_Add(r->leaves, (PyObject *)last) < 0) {
                    Py_DECREF(node);
                    goto error;
                }
                last = NULL;
            }
            int done = store_existing(r, node);
            if (done <= 0) {
                Py_DECREF(node);
                if (done < 0)
                    goto error;
                break; /* the Python loop's */
            }
            if (PyList_Append(r->chain, (PyObject *)node) < 0) {
                Py_DECREF(node);
                goto error;
            }
            Py_SETREF(parent, (PyObject *)node);
            continue;
        }
        if (run == NULL && (run = state_new(r->bit, r->now, zero)) == NULL)
            goto error;
        BlockObject *node = block_alloc(key, parent, run);
        if (node == NULL)
            goto error;
        /* no Python code ran since bt_probe (neither allocation is the collector's): the key is
         * still absent and `at` still its free slot */
        if (bt_add_at(t, node, mixed, at) < 0) {
            Py_DECREF(node);
            goto error;
        }
        /* the table owns `node` */
        r->added++;
        r->alone_n++;
        if (parent != Py_None) {
            PyObject *c = BLOCK(parent)->children;
            if (c == Py_None)
                Py_SETREF(BLOCK(parent)->children, Py_NewRef(node)); /* the usual case: no int for the key */
            else {
                PyObject *key_obj = PyLong_FromUnsignedLongLong(key);
                int r = key_obj == NULL ? -1 : block_link_child(BLOCK(parent), key_obj, node);
                Py_XDECREF(key_obj);
                if (r < 0)
                    goto error; /* the node stays in the table, as a Python error midway would leave it */
            }
            if (last == NULL) { /* the run's first parent; later ones are its own new blocks */
                int held = holders_has(BLOCK(parent)->state->holders, r->slot, r->bit);
                if (held < 0 || (held && PySet_Discard(r->leaves, parent) < 0))
                    goto error;
            }
        }
        last = node;
        if (PyList_Append(r->chain, (PyObject *)node) < 0)
            goto error;
        Py_SETREF(parent, Py_NewRef(node));
    }
    if (last != NULL && PySet_Add(r->leaves, (PyObject *)last) < 0)
        goto error;
    r->fresh = run; /* its blocks keep it alive */
    Py_XDECREF(run);
    Py_DECREF(parent);
    return i;
error:
    if (last != NULL) { /* as the Python loop would have left it when it stopped here */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (PySet_Add(r->leaves, (PyObject *)last) < 0)
            PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
    Py_XDECREF(run);
    Py_DECREF(parent);
    return -1;
}

/* store_chain's and store_hashed's checks of (block_type, parent, keys?, slot, now, leaves,
 * chain, pending, alone), filling `r`: 0, or -1 with TypeError or ValueError. `keys` NULL: not
 * checked (store_hashed hashes its own). r->bit is a new reference (store_run_close). */
static int
store_run_open(StoreRun *r, PyObject *block_type, PyObject *parent, PyObject *keys, PyObject *slot, PyObject *now,
               PyObject *leaves, PyObject *chain, PyObject *pending, PyObject *alone)
{
    r->bit = r->joined_from = r->joined = NULL;
    if (block_type != (PyObject *)&BlockType) {
        PyErr_SetString(PyExc_TypeError, "store_chain builds kvrouterd.index._native.Block");
        return -1;
    }
    if ((keys != NULL && !(PyList_CheckExact(keys) || PyObject_CheckBuffer(keys))) || !PyList_CheckExact(chain)
        || !PySet_CheckExact(leaves) || !PyLong_CheckExact(slot) || !PyDict_CheckExact(pending) || !PyDict_CheckExact(alone)) {
        PyErr_SetString(PyExc_TypeError,
                        "keys are lists or an array('Q'), chain a list, leaves a set, slot an int, pending and alone dicts");
        return -1;
    }
    if (parent != Py_None && !IS_BLOCK(parent)) {
        PyErr_SetString(PyExc_TypeError, "parent is None or a Block");
        return -1;
    }
    r->slot = PyLong_AsSsize_t(slot);
    if (r->slot < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "slot must be >= 0");
        return -1;
    }
    if ((r->bit = PyNumber_Lshift(one, slot)) == NULL)
        return -1;
    r->slot_obj = slot;
    r->now = now;
    r->leaves = leaves;
    r->chain = chain;
    r->pending = pending;
    r->alone = alone;
    r->added = r->alone_n = 0;
    r->fresh = NULL;
    return 0;
}

static void
store_run_close(StoreRun *r)
{
    Py_CLEAR(r->bit);
    Py_CLEAR(r->joined_from);
    Py_CLEAR(r->joined);
}

/* store_chain(block_type, parent, keys, start, slot, now, leaves, chain, pending, alone)
 *     -> (stop, added, alone_added)
 *
 * RadixIndex.store's loop (store_run above) from keys[start] on: `leaves` is the slot's leaf
 * set, `pending` and `alone` the index's tables (RadixIndex._pending, ._alone), updated as the
 * loop updates them. Returns the index of the first key left to the Python loop (len(keys) when
 * none), the blocks the slot holds now that it did not, and of those the ones it alone holds
 * (the loop adds both to its counts). `keys` is a list of ints or an array('Q'), read in place;
 * `block_type` is this module's Block (radix.py passes its Block). */
static PyObject *
BlockTable_store_chain(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "store_chain(block_type, parent, keys, start, slot, now, leaves, chain, pending, alone)");
        return NULL;
    }
    StoreRun r;
    if (store_run_open(&r, args[0], args[1], args[2], args[4], args[5], args[6], args[7], args[8], args[9]) < 0)
        return NULL;
    Py_ssize_t i = PyLong_AsSsize_t(args[3]);
    U64Keys keys;
    if ((i == -1 && PyErr_Occurred()) || u64_keys_open(args[2], &keys, "keys") < 0) {
        store_run_close(&r);
        return NULL;
    }
    i = store_run(t, args[1], &keys, i < 0 ? 0 : i, &r);
    u64_keys_close(&keys);
    store_run_close(&r);
    return i < 0 ? NULL : Py_BuildValue("(nnn)", i, r.added, r.alone_n);
}

/* d[key] += n, as Python's `+=` does it (KeyError when key is absent); 0 or -1 */
static int
dict_add(PyObject *d, PyObject *key, Py_ssize_t n)
{
    PyObject *was = PyDict_GetItemWithError(d, key);
    if (was == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    PyObject *by = PyLong_FromSsize_t(n);
    PyObject *sum = by == NULL ? NULL : PyNumber_Add(was, by);
    int r = sum == NULL ? -1 : PyDict_SetItem(d, key, sum);
    Py_XDECREF(by);
    Py_XDECREF(sum);
    return r;
}

/* store_hashed(block_type, parent, data, block_size, seed, slot, now, leaves, chain, pending, alone,
 *              counts, engine_map, hashes) -> (keys, stop)
 *
 * A stored event's native work in one call (issue #12: per stored event, every call from Python
 * and every object in between is a percent or two of PublishEvents' work): the chain's keys
 * (chain_keys_packed(data, block_size, seed, -1)), hashed straight into the array('Q') returned;
 * store_chain(block_type, parent, keys, 0, slot, now, leaves, chain, pending, alone) and its
 * counts added where RadixIndex.store adds them (counts[slot] += added, alone[1 << slot] +=
 * alone_added); and, when that stored every key and `engine_map` (a U64Map) is given,
 * engine_map.map_pairs(hashes, keys). Returns the keys and where store_chain stopped; when it
 * stopped short (a key left to the Python loop), the engine map is untouched and the caller goes
 * on as RadixIndex.store does from there, then maps the hashes (radix.py: RadixIndex.store_hashed,
 * the reference). `hashes`, an array('Q') or a list of ints with one hash per key, is checked
 * before anything changes. */
static PyObject *
BlockTable_store_hashed(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 14) {
        PyErr_SetString(PyExc_TypeError, "store_hashed(block_type, parent, data, block_size, seed, slot, now, leaves, "
                                         "chain, pending, alone, counts, engine_map, hashes)");
        return NULL;
    }
    PyObject *counts = args[11], *engine_map = args[12];
    StoreRun r;
    if (store_run_open(&r, args[0], args[1], NULL, args[5], args[6], args[7], args[8], args[9], args[10]) < 0)
        return NULL;
    if (engine_map != Py_None && !Py_IS_TYPE(engine_map, &U64MapType)) {
        PyErr_SetString(PyExc_TypeError, "engine_map is None or a U64Map");
        store_run_close(&r);
        return NULL;
    }
    if (!PyDict_CheckExact(counts)) {
        PyErr_SetString(PyExc_TypeError, "counts is a dict");
        store_run_close(&r);
        return NULL;
    }
    PyObject *chain_argv[4] = {args[2], args[3], args[4], minus_one};
    Py_buffer data;
    Py_ssize_t step, n;
    uint64_t seed;
    if (chain_args(chain_argv, 4, &data, &step, &n, &seed) < 0) {
        store_run_close(&r);
        return NULL;
    }
    /* array's own repeat makes the array without array()'s argument parsing (u64_array) */
    PyObject *out = PySequence_Repeat(array_q_zero, n);
    U64Keys keys, hashes;
    keys.seq = hashes.seq = NULL;
    hashes.view.obj = NULL;
    if (out == NULL || PyObject_GetBuffer(out, &keys.view, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&data);
        Py_XDECREF(out);
        store_run_close(&r);
        return NULL;
    }
    keys.n = n;
    chain_into((const char *)data.buf, step, n, seed, (uint64_t *)keys.view.buf);
    PyBuffer_Release(&data);
    if (engine_map != Py_None) {
        if (u64_keys_open(args[13], &hashes, "hashes") < 0)
            goto error;
        if (hashes.n != keys.n) {
            PyErr_Format(PyExc_ValueError, "%zd engine hashes for %zd blocks", hashes.n, keys.n);
            goto error;
        }
        for (Py_ssize_t i = 0; hashes.seq != NULL && i < hashes.n; i++) { /* ints: each a uint64? */
            uint64_t unused;
            if (u64_keys_get(&hashes, i, &unused) < 0)
                goto error;
        }
    }
    Py_ssize_t stop = store_run(t, args[1], &keys, 0, &r);
    if (stop < 0 || dict_add(counts, r.slot_obj, r.added) < 0 || dict_add(r.alone, r.bit, r.alone_n) < 0)
        goto error;
    if (stop == keys.n && engine_map != Py_None && map_pairs_run((U64Table *)engine_map, &hashes, &keys) < 0)
        goto error;
    u64_keys_close(&hashes);
    u64_keys_close(&keys); /* the array's export: it may be resized again */
    store_run_close(&r);
    return Py_BuildValue("(Nn)", out, stop);
error:
    u64_keys_close(&hashes);
    u64_keys_close(&keys);
    store_run_close(&r);
    Py_DECREF(out);
    return NULL;
}

/* ---- RadixIndex.remove's common case ---------------------------------------------------------
 *
 * Engines evict a chain from its end, so the block a removal names is nearly always a leaf of
 * the whole tree with one holder and nothing pending for its parent to inherit. For such a
 * block BlockTable.remove_held does all of RadixIndex.remove here but the slot's count (its
 * stats go, it leaves the slot's leaves, a held parent with no other held child joins them,
 * and blocks nobody holds are pruned upwards), exactly as radix.py's Python code does; for any
 * other block it changes nothing and says so, and the Python code runs. */

/* whether any child of `parent` is held by `bit`; -1 on error */
static int
held_child(BlockObject *parent, PyObject *bit)
{
    PyObject *c = parent->children;
    if (c == Py_None)
        return 0;
    if (IS_BLOCK(c)) {
        PyObject *held = PyNumber_And(BLOCK(c)->state->holders, bit);
        int r = held == NULL ? -1 : PyObject_IsTrue(held);
        Py_XDECREF(held);
        return r;
    }
    /* Read in place, stopping at the first child the worker holds: for a Block child whose
       holders are an int the check is int arithmetic, which runs no Python code (ints are not
       GC-tracked, so allocating one starts no collection) and so cannot change the dict. A
       snapshot of every value instead cost 0.6 ms under a block with 65,536 children (a shared
       system prompt) on each removal of one of them. */
    Py_ssize_t pos = 0;
    PyObject *key, *child;
    while (PyDict_CheckExact(c) && PyLong_CheckExact(bit)) {
        if (!PyDict_Next(c, &pos, &key, &child))
            return 0; /* every child read, none held */
        if (!IS_BLOCK(child) || !PyLong_CheckExact(BLOCK(child)->state->holders))
            break; /* a child from Python: the snapshot below */
        PyObject *held = PyNumber_And(BLOCK(child)->state->holders, bit);
        if (held == NULL)
            return -1;
        int r = PyObject_IsTrue(held);
        Py_DECREF(held);
        if (r != 0)
            return r;
    }
    PyObject *values = PyDict_Values(c); /* a snapshot: the checks below may run Python code */
    if (values == NULL)
        return -1;
    int r = 0;
    for (Py_ssize_t i = 0; r == 0 && i < PyList_GET_SIZE(values); i++) {
        PyObject *child = PyList_GET_ITEM(values, i);
        PyObject *holders = IS_BLOCK(child) ? Py_NewRef(BLOCK(child)->state->holders) : PyObject_GetAttr(child, holders_name);
        PyObject *held = holders == NULL ? NULL : PyNumber_And(holders, bit);
        r = held == NULL ? -1 : PyObject_IsTrue(held);
        Py_XDECREF(holders);
        Py_XDECREF(held);
    }
    Py_DECREF(values);
    return r;
}

/* RadixIndex._prune from `node` up: drop blocks nobody holds with no children. 0 or -1. */
static int
bt_prune(BlockTable *t, BlockObject *node)
{
    Py_INCREF(node);
    for (;;) {
        int held = PyObject_IsTrue(node->state->holders);
        if (held != 0 || node->children != Py_None) {
            Py_DECREF(node);
            return held < 0 ? -1 : 0;
        }
        uint64_t *slot = bt_find(t, node->key);
        if (slot == NULL || BT_BLOCK(*slot) != node) { /* already pruned through another path */
            Py_DECREF(node);
            return 0;
        }
        Py_DECREF(bt_take(t, slot)); /* the table's reference; ours keeps it alive */
        PyObject *parent = node->parent;
        if (parent != Py_None) {
            BlockObject *p = BLOCK(parent);
            if (!PyDict_CheckExact(p->children))
                Py_SETREF(p->children, Py_NewRef(Py_None));
            else {
                PyObject *c = Py_NewRef(p->children), *key = PyLong_FromUnsignedLongLong(node->key);
                int r = key == NULL ? -1 : PyDict_DelItem(c, key);
                Py_XDECREF(key);
                if (r == 0 && PyDict_GET_SIZE(c) == 1) {
                    Py_ssize_t pos = 0;
                    PyObject *k, *only;
                    PyDict_Next(c, &pos, &k, &only);
                    Py_SETREF(p->children, Py_NewRef(only));
                }
                Py_DECREF(c);
                if (r < 0) {
                    Py_DECREF(node);
                    return -1;
                }
            }
        }
        node->parent = Py_NewRef(Py_None);
        /* node's reference to its parent passes to this loop */
        Py_DECREF(node);
        if (parent == Py_None) {
            Py_DECREF(parent);
            return 0;
        }
        node = BLOCK(parent);
    }
}

/* remove_held(node, bit, leaves, pending) -> bool: RadixIndex.remove of `node`, which the
 * slot `bit` holds, but for the slot's count; False (and nothing changed) when `node` is not
 * the common case: `bit` its only holder (scalar stats), no children, nothing pending on it
 * for a held parent. */
static PyObject *
BlockTable_remove_held(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !IS_BLOCK(args[0]) || !PyLong_CheckExact(args[1]) || !PySet_CheckExact(args[2])
        || !PyDict_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "remove_held(node: Block, bit: int, leaves: set, pending: dict)");
        return NULL;
    }
    BlockObject *node = BLOCK(args[0]);
    PyObject *bit = args[1], *leaves = args[2], *pending = args[3];
    if (node->children != Py_None || PyDict_Check(node->state->last_access))
        Py_RETURN_FALSE;
    int alone = PyObject_RichCompareBool(node->state->holders, bit, Py_EQ);
    if (alone <= 0)
        return alone < 0 ? NULL : Py_NewRef(Py_False);
    PyObject *parent = Py_NewRef(node->parent); /* ours: what runs below may change the tree */
    int held_parent = 0;
    if (parent != Py_None) {
        PyObject *held = PyNumber_And(BLOCK(parent)->state->holders, bit);
        held_parent = held == NULL ? -1 : PyObject_IsTrue(held);
        Py_XDECREF(held);
    }
    int has_pending = held_parent < 0 ? -1 : PyDict_GET_SIZE(pending) ? PyDict_Contains(pending, args[0]) : 0;
    if (held_parent < 0 || has_pending < 0) {
        Py_DECREF(parent);
        return NULL;
    }
    if (held_parent && has_pending) { /* the parent inherits them: radix.py folds the two */
        Py_DECREF(parent);
        Py_RETURN_FALSE;
    }
    Py_INCREF(node);
    /* _release: its stats go (nothing else is pending for a sole holder), then its holder */
    BlockState *st = NULL;
    int ok = (!has_pending || PyDict_DelItem(pending, args[0]) == 0) && (st = block_own_state(node)) != NULL;
    if (ok) {
        Py_SETREF(st->holders, Py_NewRef(zero));
        ok = PySet_Discard(leaves, args[0]) >= 0;
    }
    if (ok && held_parent) {
        int other = held_child(BLOCK(parent), bit);
        ok = other >= 0 && (other || PySet_Add(leaves, parent) == 0);
    }
    ok = ok && bt_prune(t, node) == 0;
    Py_DECREF(node);
    Py_DECREF(parent);
    return ok ? Py_NewRef(Py_True) : NULL;
}

static PyObject *BlockTable_store_events(BlockTable *t, PyObject *const *args, Py_ssize_t nargs);

static PyMethodDef BlockTable_methods[] = {
    {"get", (PyCFunction)(void (*)(void))BlockTable_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))BlockTable_pop, METH_FASTCALL, "pop(key[, default])"},
    {"clear", (PyCFunction)BlockTable_clear, METH_NOARGS, "remove every block (unlinked) and release the table"},
    {"keys", (PyCFunction)BlockTable_keys, METH_NOARGS, "a list of the keys"},
    {"values", (PyCFunction)BlockTable_values, METH_NOARGS, "a list of the blocks"},
    {"items", (PyCFunction)BlockTable_items, METH_NOARGS, "a list of (key, block) pairs"},
    {"__sizeof__", (PyCFunction)BlockTable_sizeof, METH_NOARGS, "bytes used, the table included (not the blocks)"},
    {"store_chain", (PyCFunction)(void (*)(void))BlockTable_store_chain, METH_FASTCALL,
     "store_chain(block_type, parent, keys, start, slot, now, leaves, chain, pending, alone) -> (stop, added, "
     "alone_added): RadixIndex.store's loop, up to the first key left to it"},
    {"store_hashed", (PyCFunction)(void (*)(void))BlockTable_store_hashed, METH_FASTCALL,
     "store_hashed(block_type, parent, data, block_size, seed, slot, now, leaves, chain, pending, alone, engine_map, "
     "hashes) -> (keys bytes, stop, added, alone_added): a stored event's hashing, store_chain and engine-hash map in one call"},
    {"store_events", (PyCFunction)(void (*)(void))BlockTable_store_events, METH_FASTCALL,
     "store_events(block_type, events, start, slot, now, block_size, page, leaves, pending, alone, counts, engine_map, "
     "reverse, order, priority, index, trace) -> (next, blocks, orphans, partial): a run of plain Stored events in "
     "one call"},
    {"remove_held", (PyCFunction)(void (*)(void))BlockTable_remove_held, METH_FASTCALL,
     "remove_held(node, bit, leaves, pending) -> bool: RadixIndex.remove but the count, for a lone leaf; False: not done"},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods BlockTable_as_mapping = {
    (lenfunc)BlockTable_len, (binaryfunc)BlockTable_subscript, (objobjargproc)BlockTable_ass_subscript,
};

static PySequenceMethods BlockTable_as_sequence = {
    .sq_contains = (objobjproc)BlockTable_contains,
};

static PyTypeObject BlockTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvrouterd.index._native.BlockTable",
    .tp_doc = "A compact dict of uint64 key -> Block (RadixIndex's blocks); match_walk reads it directly.",
    .tp_basicsize = sizeof(BlockTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = BlockTable_new,
    .tp_dealloc = (destructor)BlockTable_dealloc,
    .tp_as_mapping = &BlockTable_as_mapping,
    .tp_as_sequence = &BlockTable_as_sequence,
    .tp_iter = (getiterfunc)BlockTable_iter,
    .tp_methods = BlockTable_methods,
    .tp_getset = BlockTable_getset,
};

/* ---- Overlaps: the match walk's result, slot -> depth ----------------------------------------
 *
 * What radix.py's MatchResult.overlaps holds: for each worker slot of the mask that holds the
 * request's first block, the number of leading blocks it holds. The pure walk (_walk.py) builds a
 * dict; here it is a read-only mapping over a flat array indexed by slot, so the walk writes one
 * uint32 per matched slot instead of making two ints and a dict entry (a 64-entry dict was ~30%
 * of the walk's instructions, and at 1,024 workers the dict alone costs more than a decision
 * should), and prefix_scan reads a candidate's depth by its slot number. `get`, `[]`, `in` and
 * `len` are answered from the array; everything else a dict offers (iteration, items(), ==,
 * repr) goes through an equal dict made on first use, in the pure walk's insertion order (by
 * depth, then slot), which `order` keeps. It holds only ints: no cycle-collector object. */
typedef struct {
    PyObject_VAR_HEAD /* ob_size: the uint32s in data, at least width + the order's capacity */
    Py_ssize_t width; /* data[0 .. width) is each slot's depth, 0 for a slot without an entry */
    Py_ssize_t count; /* entries so far; their slots are data[width .. width + count), in order */
    PyObject *dict;   /* the same entries as a dict, made on first need; NULL until then */
    uint32_t data[1];
} OverlapsObject;

static PyTypeObject OverlapsType;

/* The last Overlaps freed, kept for the next walk (a free list of one, as CPython keeps for its
 * own types): at 1,024 workers an Overlaps is 8 kB, which malloc and free took from and gave
 * back to glibc's bins on every decision. Only a dead one is kept (its dealloc ran), so nothing
 * that escaped to Python is reused. Not kept without a GIL (a free-threaded build), where two
 * threads could take it at once, nor past OVERLAPS_SPARE_MAX uint32s. */
#define OVERLAPS_SPARE_MAX 16384 /* 64 kB: a mask up to 8,192 slots */
#ifndef Py_GIL_DISABLED
static OverlapsObject *overlaps_spare;
#endif

/* an Overlaps without entries for slots below `width`, room for `capacity` of them in order */
static OverlapsObject *
overlaps_new(Py_ssize_t width, Py_ssize_t capacity)
{
    if (width < 0 || capacity < 0 || width > (PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(uint32_t) - 64) - capacity) {
        PyErr_SetString(PyExc_OverflowError, "match result too large");
        return NULL;
    }
    OverlapsObject *o = NULL;
#ifndef Py_GIL_DISABLED
    if (overlaps_spare != NULL && Py_SIZE(overlaps_spare) >= width + capacity) {
        o = overlaps_spare;
        overlaps_spare = NULL;
        PyObject_InitVar((PyVarObject *)o, &OverlapsType, Py_SIZE(o)); /* a new reference, as made */
    }
#endif
    if (o == NULL)
        o = PyObject_NewVar(OverlapsObject, &OverlapsType, width + capacity);
    if (o == NULL)
        return NULL;
    o->width = width;
    o->count = 0;
    o->dict = NULL;
    memset(o->data, 0, (size_t)width * sizeof(uint32_t));
    return o;
}

static void
Overlaps_dealloc(OverlapsObject *o)
{
    Py_CLEAR(o->dict);
#ifndef Py_GIL_DISABLED
    if (Py_SIZE(o) <= OVERLAPS_SPARE_MAX && (overlaps_spare == NULL || Py_SIZE(overlaps_spare) < Py_SIZE(o))) {
        /* the larger of the two stays: the next walk over the same fleet needs as much */
        OverlapsObject *old = overlaps_spare;
        overlaps_spare = o;
        if (old != NULL)
            PyObject_Free(old);
        return;
    }
#endif
    PyObject_Free(o);
}

/* the depth of `slot` (0: no entry) */
static inline uint32_t
overlaps_depth(const OverlapsObject *o, long long slot)
{
    return slot >= 0 && slot < o->width ? o->data[slot] : 0;
}

/* the entries as a dict (borrowed), made on the first call */
static PyObject *
overlaps_dict(OverlapsObject *o)
{
    if (o->dict != NULL)
        return o->dict;
    PyObject *d = _PyDict_NewPresized(o->count);
    if (d == NULL)
        return NULL;
    const uint32_t *order = o->data + o->width;
    for (Py_ssize_t i = 0; i < o->count; i++) {
        PyObject *k = PyLong_FromUnsignedLong(order[i]);
        PyObject *v = k == NULL ? NULL : PyLong_FromUnsignedLong(o->data[order[i]]);
        int r = v == NULL ? -1 : PyDict_SetItem(d, k, v);
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (r < 0) {
            Py_DECREF(d);
            return NULL;
        }
    }
    o->dict = d;
    return d;
}

/* the depth of `key` as a new int, NULL with no error when it has no entry, NULL with an error */
static PyObject *
overlaps_lookup(OverlapsObject *o, PyObject *key)
{
    if (PyLong_CheckExact(key)) {
        int overflow;
        long long slot = PyLong_AsLongLongAndOverflow(key, &overflow);
        if (slot == -1 && PyErr_Occurred())
            return NULL;
        uint32_t depth = overflow ? 0 : overlaps_depth(o, slot);
        return depth ? PyLong_FromUnsignedLong(depth) : NULL;
    }
    /* anything else equal to an int slot (True, 3.0, an int subclass) finds it as a dict would */
    PyObject *d = overlaps_dict(o);
    if (d == NULL)
        return NULL;
    PyObject *v = PyDict_GetItemWithError(d, key);
    return v == NULL ? NULL : Py_NewRef(v);
}

static Py_ssize_t
Overlaps_length(OverlapsObject *o)
{
    return o->count;
}

static PyObject *
Overlaps_subscript(OverlapsObject *o, PyObject *key)
{
    PyObject *v = overlaps_lookup(o, key);
    if (v == NULL && !PyErr_Occurred()) {
        PyObject *args = PyTuple_Pack(1, key); /* a tuple key is not taken for the arguments */
        if (args != NULL) {
            PyErr_SetObject(PyExc_KeyError, args);
            Py_DECREF(args);
        }
    }
    return v;
}

static int
Overlaps_contains(OverlapsObject *o, PyObject *key)
{
    PyObject *v = overlaps_lookup(o, key);
    if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
    Py_DECREF(v);
    return 1;
}

static PyObject *
Overlaps_get(OverlapsObject *o, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(slot, default=None)");
        return NULL;
    }
    PyObject *v = overlaps_lookup(o, args[0]);
    if (v == NULL && !PyErr_Occurred())
        return Py_NewRef(nargs == 2 ? args[1] : Py_None);
    return v;
}

/* keys(), values(), items(): the dict's views (the entries never change) */
static PyObject *
Overlaps_view(OverlapsObject *o, const char *name)
{
    PyObject *d = overlaps_dict(o);
    return d == NULL ? NULL : PyObject_CallMethod(d, name, NULL);
}

static PyObject *Overlaps_keys(OverlapsObject *o, PyObject *unused) { return Overlaps_view(o, "keys"); }
static PyObject *Overlaps_values(OverlapsObject *o, PyObject *unused) { return Overlaps_view(o, "values"); }
static PyObject *Overlaps_items(OverlapsObject *o, PyObject *unused) { return Overlaps_view(o, "items"); }

static PyObject *
Overlaps_iter(OverlapsObject *o)
{
    PyObject *d = overlaps_dict(o);
    return d == NULL ? NULL : PyObject_GetIter(d);
}

static PyObject *
Overlaps_richcompare(OverlapsObject *o, PyObject *other, int op)
{
    if (op != Py_EQ && op != Py_NE)
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *d = overlaps_dict(o);
    if (d == NULL)
        return NULL;
    if (Py_IS_TYPE(other, &OverlapsType)) {
        other = overlaps_dict((OverlapsObject *)other);
        if (other == NULL)
            return NULL;
    }
    return PyObject_RichCompare(d, other, op);
}

static PyObject *
Overlaps_repr(OverlapsObject *o)
{
    PyObject *d = overlaps_dict(o);
    return d == NULL ? NULL : PyObject_Repr(d);
}

static PyMethodDef Overlaps_methods[] = {
    {"get", (PyCFunction)(void (*)(void))Overlaps_get, METH_FASTCALL, "get(slot, default=None): the slot's depth, or default"},
    {"keys", (PyCFunction)Overlaps_keys, METH_NOARGS, "the slots with an entry, in the pure walk's order"},
    {"values", (PyCFunction)Overlaps_values, METH_NOARGS, "their depths"},
    {"items", (PyCFunction)Overlaps_items, METH_NOARGS, "(slot, depth) pairs"},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods Overlaps_as_mapping = {
    .mp_length = (lenfunc)Overlaps_length,
    .mp_subscript = (binaryfunc)Overlaps_subscript,
};

static PySequenceMethods Overlaps_as_sequence = {
    .sq_contains = (objobjproc)Overlaps_contains,
};

static PyTypeObject OverlapsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvrouterd.index._native.Overlaps",
    .tp_doc = "The match walk's slot -> depth mapping (read-only; equal to the pure walk's dict).",
    .tp_basicsize = offsetof(OverlapsObject, data),
    .tp_itemsize = sizeof(uint32_t),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Overlaps_dealloc,
    .tp_repr = (reprfunc)Overlaps_repr,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_as_mapping = &Overlaps_as_mapping,
    .tp_as_sequence = &Overlaps_as_sequence,
    .tp_richcompare = (richcmpfunc)Overlaps_richcompare,
    .tp_iter = (getiterfunc)Overlaps_iter,
    .tp_methods = Overlaps_methods,
};

/* ---- the walk over holder sets of any width ------------------------------------------------
 *
 * A block's holders are an int bitmask over slots (radix.py), as wide as its highest holder's
 * slot: 1,024 workers make 1,024-bit ints. The walk keeps the slots still matching as the
 * mask's CPython digits (PyLong_SHIFT bits each, least significant first) and reads each
 * block's holders digits in place, so no int is converted or made per block; only the digits
 * between the lowest and the highest slot still matching are visited (`lo`, `hi`), so once the
 * matching slots sit in one digit, a block costs what a 64-bit mask did, whatever the fleet's
 * size. (CPython >= 3.11 stores an int so: longintrepr.h, included by Python.h.) */

#define WALK_STACK_DIGITS 160 /* 4,800 slots: MAX_WORKERS (4,096) without an allocation */

typedef struct {
    PyObject *mask;      /* the slots_mask int (borrowed): what a negative holders is cut to */
    digit *act;          /* the slots still matching, as the mask's digits */
    Py_ssize_t lo, hi;   /* act's digits below lo and from hi on are 0 */
    OverlapsObject *out; /* made once the first block has narrowed the slots; NULL before */
    digit act_stack[WALK_STACK_DIGITS];
} Walk;

static void
walk_release(Walk *w)
{
    if (w->act != w->act_stack)
        PyMem_Free(w->act);
    Py_CLEAR(w->out);
}

/* w ready to walk `mask` (a non-negative int, checked by the caller); 0, or -1 with MemoryError */
static int
walk_init(Walk *w, PyObject *mask)
{
    const digit *d;
    Py_ssize_t n = long_digits(mask, &d);
    w->mask = mask;
    w->out = NULL;
    w->act = w->act_stack;
    if (n > WALK_STACK_DIGITS) {
        w->act = PyMem_New(digit, (size_t)n);
        if (w->act == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    memcpy(w->act, d, (size_t)n * sizeof(digit));
    w->lo = 0;
    w->hi = n; /* CPython keeps no leading zero digit */
    return 0;
}

/* Give every slot of `bits` (digit `i` of the mask) the entry `depth`, lowest slot first. Each
 * slot gets at most one (it leaves the walk's slots as it does), and is below `out`'s width and
 * within its capacity, both measured on the slots the first block left (walk_first). The count
 * is kept in a local: through `o`, each store to the arrays made it be read again. */
static inline void
walk_record(Walk *w, digit bits, Py_ssize_t i, Py_ssize_t depth)
{
    OverlapsObject *o = w->out;
    uint32_t *data = o->data, *order = o->data + o->width;
    Py_ssize_t count = o->count;
    uint32_t base = (uint32_t)(i * PyLong_SHIFT);
    while (bits) {
        uint32_t slot = base + (uint32_t)__builtin_ctz(bits);
        data[slot] = (uint32_t)depth;
        order[count++] = slot;
        bits &= bits - 1;
    }
    o->count = count;
}

/* Digits [i, end) of the slots still matching lose the slots `h` lacks, each recorded at `depth`
 * (none at depth 0: a slot without the first block has no entry). 1 if one did, else 0. */
static inline int
walk_drop(Walk *w, const digit *h, Py_ssize_t i, Py_ssize_t end, Py_ssize_t depth)
{
    digit *act = w->act;
    int dropped = 0;
    for (; i < end; i++) {
        digit gone = act[i] & ~h[i];
        if (gone) {
            if (depth)
                walk_record(w, gone, i, depth);
            act[i] ^= gone;
            dropped = 1;
        }
    }
    return dropped;
}

/* four digits in one vector register (GCC's and Clang's vector extension: SSE2 on x86-64, NEON
 * on arm64), read unaligned, as an int's digits are */
typedef uint32_t walk_quad __attribute__((vector_size(16)));

static inline walk_quad
walk_load(const digit *p)
{
    walk_quad v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The slots of `act`'s digits [i, i + 4 * quads) that `h` lacks (1 <= quads <= 2) into gone[0 ..
 * 4 * quads); whether there is one. */
static inline int
walk_gone(const digit *act, const digit *h, Py_ssize_t i, int quads, digit *gone)
{
    walk_quad g0 = walk_load(act + i) & ~walk_load(h + i), any = g0;
    memcpy(gone, &g0, sizeof g0);
    if (quads == 2) {
        walk_quad g1 = walk_load(act + i + 4) & ~walk_load(h + i + 4);
        memcpy(gone + 4, &g1, sizeof g1);
        any |= g1;
    }
    uint64_t half[2];
    memcpy(half, &any, sizeof half);
    return (half[0] | half[1]) != 0;
}

/* The slots `gone` holds for digits [i, i + n) leave the walk, each recorded at `depth` (none at
 * depth 0: a slot without the first block has no entry). */
static inline void
walk_drop_gone(Walk *w, const digit *gone, Py_ssize_t i, int n, Py_ssize_t depth)
{
    for (int k = 0; k < n; k++) {
        if (gone[k]) {
            if (depth)
                walk_record(w, gone[k], i + k, depth);
            w->act[i + k] ^= gone[k];
        }
    }
}

/* One block of a walk at `depth`: intersect the slots still matching with the block's holders
 * (an int, borrowed), recording `depth` as the overlap of every slot that drops out (none at
 * depth 0: a slot without the first block has no entry). 1: the last slots dropped out here and
 * the walk ends; 0: go on (also with no slot at all: an empty mask walks every block present,
 * as the pure walk does); -1: error. Runs no Python code and allocates nothing for a non-negative int.
 *
 * The digits are read in runs of eight (then four, then the last few one by one): two vector
 * ANDs and one test ask whether a slot in the run drops out, and only in a run where one does
 * are the ANDs' digits looked at one by one. Most blocks drop no slot; one that does usually
 * drops a few, within one run: at 1,024 workers (35 digits) a block that loses a worker cost
 * ~310 instructions when every digit was read twice. Inlined into the walks' loops: a call
 * saved and restored six registers per block. */
static inline __attribute__((always_inline)) int
walk_step(Walk *w, PyObject *holders, Py_ssize_t depth)
{
    const digit *h;
    Py_ssize_t hn = long_digits(holders, &h);
    PyObject *cut = NULL;
    if (hn < 0) { /* two's complement: every bit above its digits is set; cut to the mask */
        cut = PyNumber_And(w->mask, holders);
        if (cut == NULL)
            return -1;
        hn = long_digits(cut, &h);
    }
    digit *act = w->act;
    Py_ssize_t lo = w->lo, hi = w->hi;
    Py_ssize_t both = hn < hi ? hn : hi; /* digits of act from `both` on meet zeros */
    int dropped = 0;
    Py_ssize_t i = lo;
    digit gone[8];
    for (; i + 8 <= both; i += 8) {
        if (walk_gone(act, h, i, 2, gone)) {
            walk_drop_gone(w, gone, i, 8, depth);
            dropped = 1;
        }
    }
    if (i + 4 <= both) {
        if (walk_gone(act, h, i, 1, gone)) {
            walk_drop_gone(w, gone, i, 4, depth);
            dropped = 1;
        }
        i += 4;
    }
    dropped |= walk_drop(w, h, i, both, depth); /* the last 0-3 digits */
    for (i = both; i < hi; i++) { /* holders end below: every slot left up here drops out */
        if (act[i]) {
            if (depth)
                walk_record(w, act[i], i, depth);
            act[i] = 0;
            dropped = 1;
        }
    }
    int ends = 0;
    if (dropped) {
        while (lo < hi && !act[lo])
            lo++;
        while (hi > lo && !act[hi - 1])
            hi--;
        w->lo = lo;
        w->hi = hi;
        ends = lo == hi;
    }
    Py_XDECREF(cut);
    return ends;
}

/* After the first block: the result, as wide as the highest slot left and with room for all
 * of them. 0, or -1 with an error. */
static int
walk_first(Walk *w)
{
    Py_ssize_t width = 0;
    if (w->lo < w->hi) {
        Py_ssize_t top = w->hi - 1;
        if (top > ((Py_ssize_t)UINT32_MAX - 32) / PyLong_SHIFT) {
            PyErr_SetString(PyExc_OverflowError, "slots_mask holds a slot of 2**32 or more");
            return -1;
        }
        width = top * PyLong_SHIFT + (Py_ssize_t)(32 - __builtin_clz(w->act[top]));
    }
    /* room in order for every slot below the width, not counted (a popcount per digit, which
     * without -mpopcnt is a libgcc call each): the same size as a walk's before over the same
     * fleet, so the spare fits */
    w->out = overlaps_new(width, width);
    return w->out == NULL ? -1 : 0;
}

/* The walk ended at `depth` (blocks matched): the slots left hold them all. The result (a new
 * reference), made empty if no block matched. */
static PyObject *
walk_finish(Walk *w, Py_ssize_t depth)
{
    if (w->out == NULL) {
        w->out = overlaps_new(0, 0);
        if (w->out == NULL)
            return NULL;
    }
    if (depth)
        for (Py_ssize_t i = w->lo; i < w->hi; i++)
            walk_record(w, w->act[i], i, depth);
    PyObject *out = (PyObject *)w->out;
    w->out = NULL;
    return out;
}

static PyObject *match_walk_table(BlockTable *t, const uint64_t *keys, Py_ssize_t nkeys, Walk *w);
static PyObject *match_walk_table_seq(BlockTable *t, PyObject *seq, Walk *w);

/* holders of a block found in a dict of blocks (a new reference to an int), or NULL */
static PyObject *
holders_of(PyObject *node)
{
    if (IS_BLOCK(node))
        return Py_NewRef(BLOCK(node)->state->holders);
    PyObject *h = PyObject_GetAttr(node, holders_name);
    if (h == NULL || PyLong_Check(h))
        return h;
    Py_SETREF(h, PyNumber_Index(h)); /* what `active & holders` would make of it */
    return h;
}

/* match_walk(blocks: dict | BlockTable, keys: sequence, slots_mask: int) -> (overlaps, path)
 * `overlaps` is an Overlaps (above), equal to the pure walk's dict (_walk.py: match_walk_py). */
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
    const digit *unused;
    if (long_digits(args[2], &unused) < 0) {
        PyErr_SetString(PyExc_ValueError, "slots_mask must be >= 0");
        return NULL;
    }
    Walk walk; /* ~700 bytes on the C stack: from the heap it was a glibc malloc per walk */
    Walk *w = &walk;
    PyObject *mask = Py_NewRef(args[2]); /* ours while a foreign holders attribute runs code */
    PyObject *result = NULL;
    if (walk_init(w, mask) < 0)
        goto done;

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
            goto done;
        }
        result = match_walk_table((BlockTable *)blocks, (const uint64_t *)view.buf, view.len / 8, w);
        PyBuffer_Release(&view);
        goto done;
    }
as_sequence:;
    PyObject *seq = PySequence_Fast(args[1], "keys must be a sequence");
    if (seq == NULL)
        goto done;
    if (is_table) {
        result = match_walk_table_seq((BlockTable *)blocks, seq, w);
        Py_DECREF(seq);
        goto done;
    }
    PyObject *path = PyList_New(0);
    if (path == NULL)
        goto seq_done;
    Py_ssize_t depth = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        if (depth >= (Py_ssize_t)UINT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "a match of 2**32 blocks or more");
            goto seq_error;
        }
        PyObject *node = PyDict_GetItemWithError(blocks, PySequence_Fast_GET_ITEM(seq, i)); /* borrowed */
        if (node == NULL) {
            if (PyErr_Occurred())
                goto seq_error;
            break;
        }
        /* owned from here: any allocation may run a collection whose finalizers change `blocks` */
        Py_INCREF(node);
        PyObject *holders = holders_of(node);
        int step = holders == NULL ? -1 : walk_step(w, holders, depth);
        Py_XDECREF(holders);
        if (step >= 0 && depth == 0 && walk_first(w) < 0)
            step = -1;
        if (step == 0 && PyList_Append(path, node) < 0)
            step = -1;
        Py_DECREF(node);
        if (step < 0)
            goto seq_error;
        if (step > 0)
            break;
        depth++;
    }
    PyObject *overlaps = walk_finish(w, depth);
    if (overlaps == NULL)
        goto seq_error;
    result = PyTuple_Pack(2, overlaps, path);
    Py_DECREF(overlaps);
seq_error:
    Py_DECREF(path);
seq_done:
    Py_DECREF(seq);
done:
    walk_release(w);
    Py_DECREF(mask);
    return result;
}

/* ---- the match walk over a BlockTable, with the memory latency overlapped -----------------
 *
 * In a 10^6-block index every block of the walk is a cache miss or two: the table slot, the
 * Block (its key is compared, its holders read). The keys are all known up front, so instead of
 * paying them one after another, the walk prefetches: table slots WALK_AHEAD keys ahead, and
 * the Block a slot's first entry points at WALK_BLOCK_AHEAD keys ahead (by then that slot is in
 * cache; when the key sits further along the run the prefetch is merely wasted).
 */
#define WALK_AHEAD 8
#define WALK_STACK_NODES 256 /* 2 kB of Block pointers */
#define WALK_BLOCK_AHEAD 4
/* As written, GCC 12 deletes these prefetches (see PREFETCH_HELPER): the walk has never run them.
 * Made to run, they cost the decision benchmark's repeated (cached) prompt ~0.4 us a decision
 * (10.2 -> 10.6 us, 64 workers, 1M blocks; issue #30); what they save on prompts not in cache is
 * unmeasured, so the walk is left as it was. */

/* keys given as int objects: converted, up to the first that can't be a key (outside uint64) */
static PyObject *
match_walk_table_seq(BlockTable *t, PyObject *seq, Walk *w)
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
    PyObject *result = match_walk_table(t, keys, nkeys, w);
    PyMem_Free(keys);
    return result;
}

static inline void
walk_prefetch_block(const BlockTable *t, uint64_t key)
{
    uint64_t mixed = u64_mix(key);
    uint64_t e = t->cur.slots[home_of_mixed(mixed, t->cur.capacity)];
    if (!e && t->old.slots != NULL) /* growing: the block may not have moved yet */
        e = t->old.slots[home_of_mixed(mixed, t->old.capacity)];
    if (e)
        __builtin_prefetch(BT_BLOCK(e));
}

/* the home slot of `key` on its way into cache, in both arrays while the table grows */
static inline void
walk_prefetch_slot(const BlockTable *t, uint64_t key)
{
    uint64_t mixed = u64_mix(key);
    __builtin_prefetch(&t->cur.slots[home_of_mixed(mixed, t->cur.capacity)]);
    if (t->old.slots != NULL)
        __builtin_prefetch(&t->old.slots[home_of_mixed(mixed, t->old.capacity)]);
}

static PyObject *
match_walk_table(BlockTable *t, const uint64_t *keys, Py_ssize_t nkeys, Walk *w)
{
    if (nkeys > (Py_ssize_t)UINT32_MAX) /* depths are uint32 */
        nkeys = (Py_ssize_t)UINT32_MAX;
    Py_ssize_t found = 0;
    /* a prompt of up to WALK_STACK_NODES blocks (4,096 tokens of 16) without a glibc malloc */
    BlockObject *nodes_stack[WALK_STACK_NODES];
    BlockObject **nodes = nkeys <= WALK_STACK_NODES ? nodes_stack
                                                    : PyMem_Malloc((size_t)nkeys * sizeof(BlockObject *));
    PyObject *overlaps = NULL;
    PyObject *path = NULL;
    if (nodes == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    /* pass 1: the blocks present, up to the first key the index does not have */
    for (Py_ssize_t i = 0; i < nkeys && i < WALK_AHEAD; i++) {
        walk_prefetch_slot(t, keys[i]);
        if (i == WALK_BLOCK_AHEAD)
            for (Py_ssize_t k = 0; k < WALK_BLOCK_AHEAD && k < nkeys; k++)
                walk_prefetch_block(t, keys[k]);
    }
    for (; found < nkeys; found++) {
        if (found + WALK_AHEAD < nkeys)
            walk_prefetch_slot(t, keys[found + WALK_AHEAD]);
        if (found + WALK_BLOCK_AHEAD < nkeys)
            walk_prefetch_block(t, keys[found + WALK_BLOCK_AHEAD]);
        uint64_t *slot = bt_find(t, keys[found]);
        if (slot == NULL)
            break;
        /* owned: pass 2 allocates, and a collection's finalizers could change the table */
        nodes[found] = (BlockObject *)Py_NewRef(BT_BLOCK(*slot));
    }
    /* pass 2: intersect holder sets along the path. Nothing here runs Python code (Overlaps is no
     * collector object, so making it runs no collection): the Blocks' states stay as read, and
     * their holders alive. A block whose holders are the very int of the block before drops no
     * slot (those left hold that int already), so its digits are not read: a stored chain's
     * blocks with the same holders share one int (store_existing). */
    Py_ssize_t depth = 0;
    PyObject *last = NULL;
    for (; depth < found; depth++) {
        PyObject *holders = nodes[depth]->state->holders;
        if (holders == last)
            continue;
        last = holders;
        int step = walk_step(w, holders, depth);
        if (step >= 0 && depth == 0 && walk_first(w) < 0)
            step = -1;
        if (step < 0)
            goto error;
        if (step > 0)
            break;
    }
    overlaps = walk_finish(w, depth);
    if (overlaps == NULL)
        goto error;
    path = PyList_New(depth);
    if (path == NULL)
        goto error;
    for (Py_ssize_t i = 0; i < depth; i++)
        PyList_SET_ITEM(path, i, (PyObject *)nodes[i]); /* the path takes over these references */
    for (Py_ssize_t i = depth; i < found; i++)
        Py_DECREF(nodes[i]);
    if (nodes != nodes_stack)
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
    if (nodes != nodes_stack)
        PyMem_Free(nodes);
    Py_XDECREF(overlaps);
    Py_XDECREF(path);
    return NULL;
}

/* chain_split(blocks, prio) -> (continued, ends): for a stored chain, the blocks the chain
 * continues from (blocks[i + 1].parent is blocks[i], so block i has a held child) that are
 * keys of the dict `prio` (the leaf tracker keys it by Block, hashed by identity: no int is
 * made per block), and the blocks it does not continue from (the last one included).
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
            if (IS_BLOCK(next))
                parent = Py_NewRef(BLOCK(next)->parent);
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
            r = PyDict_GET_SIZE(prio) ? PyDict_Contains(prio, b) : 0;
            if (r > 0)
                r = PyList_Append(continued, b);
        }
        else
            r = PyList_Append(ends, b);
        Py_DECREF(b);
        if (r < 0)
            goto error_owned;
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

/* ---- LeafOrder: one worker slot's leaves, sorted by a numeric priority ------------------------
 *
 * The leaf tracker's container (policies/eviction/_leaves.py, SortedLeaves; its pure reference is
 * PyLeafOrder there) for a priority that is a real number, as lru's recency is: the leaves as
 * entries (priority: double, key: uint64, Block) in ascending (priority, key) order, and a table
 * from a Block's address to its priority (a leaf is found by its Block, as the reference's dict
 * keyed by Block finds it). The order is sortedcontainers' two-level SortedList in C: runs of at
 * most 2 * LEAF_LOAD entries, with each run's greatest (priority, key) beside it, so an insert or
 * a removal bisects the runs, then one run, and moves the tail of that run only. lru's new leaves
 * are the most recent, so they are appended to the last run; evictions take the oldest first.
 *
 * It holds Blocks only, which are outside the cycle collector and never refer to a LeafOrder,
 * so it is no collector object either: a full collection does not visit its 400k leaves.
 *
 * `stored` is the tracker's hook for a stored chain (the work PublishEvents does per event for
 * lru) in one call: the chain's split (chain_split above), the ends' leaf checks and their
 * priorities, read through the policy's Python callable. */

#define LEAF_LOAD 256 /* a run is split past 2 * LEAF_LOAD entries, merged below LEAF_LOAD / 4 */

typedef struct {
    double prio;
    uint64_t key;
    BlockObject *block; /* a strong reference */
} LeafEntry;

typedef struct {
    LeafEntry *e;
    Py_ssize_t len, cap;
    double max_prio; /* e[len - 1]'s (prio, key): runs are never empty */
    uint64_t max_key;
} LeafRun;

typedef struct {
    PyObject_HEAD
    LeafRun *runs;
    Py_ssize_t nruns, runs_cap;
    Py_ssize_t size;
    uint64_t version; /* changes with every insert and removal: an iterator checks it */
    /* a Block's address -> its priority's bits, kept at most half full (sparse: doubling past
     * that): most lookups in `stored` are for blocks that are not there (the chain's new
     * blocks), and a linear probe for a missing key looks at ~13 slots at U64Map's load of 0.8
     * against ~2.5 at 0.5. It grows incrementally as U64Map does. */
    U64Store where;
} LeafOrder;

static PyTypeObject LeafOrderType, LeafOrderIterType;

static inline int
leaf_less(double pa, uint64_t ka, double pb, uint64_t kb)
{
    return pa < pb || (pa == pb && ka < kb);
}

static inline uint64_t
leaf_addr(BlockObject *b)
{
    return (uint64_t)(uintptr_t)b;
}

static inline uint64_t
prio_bits(double p)
{
    uint64_t u;
    memcpy(&u, &p, sizeof u);
    return u;
}

static inline double
bits_prio(uint64_t u)
{
    double p;
    memcpy(&p, &u, sizeof p);
    return p;
}

/* the first run whose greatest entry is >= (p, k), or > (p, k) if `after`; nruns if none */
static Py_ssize_t
lo_run_at(const LeafOrder *o, double p, uint64_t k, int after)
{
    Py_ssize_t lo = 0, hi = o->nruns;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        const LeafRun *r = &o->runs[mid];
        if (after ? !leaf_less(p, k, r->max_prio, r->max_key) : leaf_less(r->max_prio, r->max_key, p, k))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* the first entry of `r` that is >= (p, k), or > (p, k) if `after`; r->len if none */
static Py_ssize_t
run_at(const LeafRun *r, double p, uint64_t k, int after)
{
    Py_ssize_t lo = 0, hi = r->len;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        const LeafEntry *e = &r->e[mid];
        if (after ? !leaf_less(p, k, e->prio, e->key) : leaf_less(e->prio, e->key, p, k))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* room for `n` entries in `r`; 0 or -1 (MemoryError, nothing changed) */
static int
run_reserve(LeafRun *r, Py_ssize_t n)
{
    if (n <= r->cap)
        return 0;
    Py_ssize_t cap = r->cap ? r->cap : 8;
    while (cap < n)
        cap *= 2;
    LeafEntry *e = PyMem_Realloc(r->e, (size_t)cap * sizeof(LeafEntry));
    if (e == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    r->e = e;
    r->cap = cap;
    return 0;
}

/* an empty run at position i of the runs; 0 or -1 (MemoryError, nothing changed) */
static int
lo_add_run(LeafOrder *o, Py_ssize_t i)
{
    if (o->nruns == o->runs_cap) {
        Py_ssize_t cap = o->runs_cap ? o->runs_cap * 2 : 4;
        LeafRun *runs = PyMem_Realloc(o->runs, (size_t)cap * sizeof(LeafRun));
        if (runs == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        o->runs = runs;
        o->runs_cap = cap;
    }
    memmove(&o->runs[i + 1], &o->runs[i], (size_t)(o->nruns - i) * sizeof(LeafRun));
    o->runs[i] = (LeafRun){NULL, 0, 0, 0.0, 0};
    o->nruns++;
    return 0;
}

/* run i (emptied) freed and taken out of the runs */
static void
lo_del_run(LeafOrder *o, Py_ssize_t i)
{
    PyMem_Free(o->runs[i].e);
    memmove(&o->runs[i], &o->runs[i + 1], (size_t)(o->nruns - i - 1) * sizeof(LeafRun));
    o->nruns--;
}

static inline void
run_set_max(LeafRun *r)
{
    r->max_prio = r->e[r->len - 1].prio;
    r->max_key = r->e[r->len - 1].key;
}

/* run i, past 2 * LEAF_LOAD entries, as two; on MemoryError it stays one (still in order) */
static void
lo_split(LeafOrder *o, Py_ssize_t i)
{
    if (lo_add_run(o, i + 1) < 0) {
        PyErr_Clear(); /* a long run is slower to change, not wrong */
        return;
    }
    LeafRun *r = &o->runs[i], *upper = &o->runs[i + 1];
    Py_ssize_t half = r->len / 2;
    if (run_reserve(upper, r->len - half) < 0) {
        PyErr_Clear();
        lo_del_run(o, i + 1);
        return;
    }
    memcpy(upper->e, &r->e[half], (size_t)(r->len - half) * sizeof(LeafEntry));
    upper->len = r->len - half;
    r->len = half;
    run_set_max(upper);
    run_set_max(r);
}

/* (p, b) into the order (not the table); 0 or -1 (MemoryError, nothing changed) */
static int
lo_insert(LeafOrder *o, double p, BlockObject *b)
{
    uint64_t k = b->key;
    if (o->nruns == 0 && lo_add_run(o, 0) < 0)
        return -1;
    Py_ssize_t i = lo_run_at(o, p, k, 0);
    if (i == o->nruns)
        i--; /* past every entry: the end of the last run */
    LeafRun *r = &o->runs[i];
    if (run_reserve(r, r->len + 1) < 0) {
        if (r->len == 0)
            lo_del_run(o, i);
        return -1;
    }
    Py_ssize_t j = run_at(r, p, k, 0);
    memmove(&r->e[j + 1], &r->e[j], (size_t)(r->len - j) * sizeof(LeafEntry));
    r->e[j] = (LeafEntry){p, k, (BlockObject *)Py_NewRef(b)};
    r->len++;
    if (j == r->len - 1)
        run_set_max(r);
    o->size++;
    o->version++;
    if (r->len > 2 * LEAF_LOAD)
        lo_split(o, i);
    return 0;
}

/* the entry (p, b) out of the order (not the table), its reference returned to the caller;
 * NULL (SystemError) if it is not there, which the table says it is */
static BlockObject *
lo_take(LeafOrder *o, double p, BlockObject *b)
{
    uint64_t k = b->key;
    Py_ssize_t i = lo_run_at(o, p, k, 0);
    LeafRun *r = i < o->nruns ? &o->runs[i] : NULL;
    Py_ssize_t j = r != NULL ? run_at(r, p, k, 0) : 0;
    if (r == NULL || j == r->len || r->e[j].block != b) {
        PyErr_SetString(PyExc_SystemError, "LeafOrder: a leaf in its table is missing from its order");
        return NULL;
    }
    memmove(&r->e[j], &r->e[j + 1], (size_t)(r->len - j - 1) * sizeof(LeafEntry));
    r->len--;
    o->size--;
    o->version++;
    if (r->len == 0) {
        lo_del_run(o, i);
        return b;
    }
    if (j == r->len)
        run_set_max(r);
    if (r->len < LEAF_LOAD / 4 && o->nruns > 1) {
        /* a short run joins a neighbour when the two fit in one (else it stays, and goes
         * when it empties) */
        Py_ssize_t a = i + 1 < o->nruns ? i : i - 1;
        LeafRun *low = &o->runs[a], *high = &o->runs[a + 1];
        if (low->len + high->len <= 2 * LEAF_LOAD) {
            if (run_reserve(low, low->len + high->len) < 0)
                PyErr_Clear(); /* left apart: still in order */
            else {
                memcpy(&low->e[low->len], high->e, (size_t)high->len * sizeof(LeafEntry));
                low->len += high->len;
                run_set_max(low);
                high->len = 0;
                lo_del_run(o, a + 1);
            }
        }
    }
    return b;
}

/* b's priority into *p: 1 if b is in the order, else 0 */
static inline int
lo_get(const LeafOrder *o, BlockObject *b, double *p)
{
    const uint64_t *bits = us_find(&o->where, leaf_addr(b));
    if (bits == NULL)
        return 0;
    *p = bits_prio(*bits);
    return 1;
}

/* b at priority p, as a new leaf or re-scored (the reference's SortedLeaves._set); 0 or -1.
 * On MemoryError a re-scored b is left out of both (its slot then ranks from the index:
 * SortedLeaves.sorted_view sees fewer leaves than the index has). */
static int
lo_put(LeafOrder *o, BlockObject *b, double p)
{
    if (Py_IS_NAN(p)) {
        PyErr_SetString(PyExc_ValueError, "a leaf's priority is a number, not NaN");
        return -1;
    }
    uint64_t addr = leaf_addr(b);
    const uint64_t *bits = us_find(&o->where, addr);
    if (bits != NULL) {
        double old = bits_prio(*bits);
        if (old == p)
            return 0;
        BlockObject *taken = lo_take(o, old, b); /* its reference keeps b alive until re-inserted */
        if (taken == NULL)
            return -1;
        int r = lo_insert(o, p, b);
        Py_DECREF(taken);
        if (r < 0) {
            us_remove(&o->where, addr, NULL);
            return -1;
        }
        *us_find(&o->where, addr) = prio_bits(p);
        return 0;
    }
    if (us_reserve(&o->where) < 0 || lo_insert(o, p, b) < 0)
        return -1;
    us_add(&o->where, addr, prio_bits(p));
    return 0;
}

/* b out of the order if it is in (the reference's SortedLeaves._drop); 0 or -1 */
static int
lo_drop(LeafOrder *o, BlockObject *b)
{
    uint64_t bits;
    if (!us_remove(&o->where, leaf_addr(b), &bits))
        return 0;
    double old = bits_prio(bits);
    BlockObject *taken = lo_take(o, old, b);
    if (taken == NULL)
        return -1;
    Py_DECREF(taken);
    return 0;
}

/* the runs, detached from the order already: their references dropped, their memory freed */
static void
lo_free_runs(LeafRun *runs, Py_ssize_t nruns)
{
    for (Py_ssize_t i = 0; i < nruns; i++) {
        for (Py_ssize_t j = 0; j < runs[i].len; j++)
            Py_DECREF(runs[i].e[j].block);
        PyMem_Free(runs[i].e);
    }
    PyMem_Free(runs);
}

/* every entry out, the table emptied; 0 or -1 (MemoryError: the empty table was not made) */
static int
lo_clear(LeafOrder *o)
{
    if (us_reset(&o->where) < 0)
        return -1;
    LeafRun *runs = o->runs;
    Py_ssize_t nruns = o->nruns;
    o->runs = NULL;
    o->nruns = o->runs_cap = o->size = 0;
    o->version++;
    lo_free_runs(runs, nruns); /* last: the order is whole (empty) while blocks are freed */
    return 0;
}

static PyObject *
LeafOrder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_Format(PyExc_TypeError, "%.100s() takes no arguments", type->tp_name);
        return NULL;
    }
    LeafOrder *o = (LeafOrder *)type->tp_alloc(type, 0); /* zero-filled */
    if (o == NULL)
        return NULL;
    if (us_init(&o->where, TABLE_MIN_CAPACITY, 1, 0) < 0) {
        Py_DECREF(o);
        return NULL;
    }
    return (PyObject *)o;
}

static void
LeafOrder_dealloc(LeafOrder *o)
{
    lo_free_runs(o->runs, o->nruns);
    us_free(&o->where);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static Py_ssize_t
LeafOrder_len(LeafOrder *o)
{
    return o->size;
}

static int
leaf_block_arg(PyObject *obj)
{
    if (IS_BLOCK(obj))
        return 0;
    PyErr_Format(PyExc_TypeError, "a LeafOrder holds native Blocks, not %.100s", Py_TYPE(obj)->tp_name);
    return -1;
}

/* a priority as a double; -1 with an error set when it is no real number */
static int
leaf_prio_arg(PyObject *obj, double *p)
{
    if (PyFloat_CheckExact(obj)) {
        *p = PyFloat_AS_DOUBLE(obj);
        return 0;
    }
    if (!PyFloat_Check(obj) && !PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "a LeafOrder's priorities are real numbers, not %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    *p = PyFloat_AsDouble(obj);
    return *p == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* RadixIndex.recency(index, b, slot) for a leaf, without the call (a Python call per stored
 * event was a tenth of the hook's cost; per Route, ~2k instructions of the access record): when
 * the slot last stored or used b, its own last_access or an access pending on it (index._pending,
 * read once a call into *pending), whichever is later. `leaf`: b has no child the slot holds (the
 * caller checked), so no access pending below it counts; else a block with children is left to
 * the method. 1 with *p; 0 when the Python method must answer (a child held or not known to be,
 * a last_access or pending time not a float); -1 on error. radix.py's method is the reference. */
static int
leaf_recency(PyObject *index, BlockObject *b, PyObject *slotobj, int leaf, PyObject **pending, double *p)
{
    if (b->children != Py_None && !leaf)
        return 0;
    PyObject *la = b->state->last_access;
    if (PyDict_CheckExact(la) && (la = PyDict_GetItemWithError(la, slotobj)) == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyFloat_CheckExact(la))
        return 0;
    if (*pending == NULL && (*pending = PyObject_GetAttr(index, pending_name)) == NULL)
        return -1;
    if (!PyDict_CheckExact(*pending))
        return 0;
    *p = PyFloat_AS_DOUBLE(la);
    if (!PyDict_GET_SIZE(*pending))
        return 1;
    /* a block one slot holds keeps (time, hits) there, a shared one a dict of them by slot */
    PyObject *up = PyDict_GetItemWithError(*pending, (PyObject *)b);
    if (up != NULL && PyDict_CheckExact(up))
        up = PyDict_GetItemWithError(up, slotobj);
    if (up == NULL)
        return PyErr_Occurred() ? -1 : 1;
    if (!PyTuple_CheckExact(up) || PyTuple_GET_SIZE(up) < 1 || !PyFloat_CheckExact(PyTuple_GET_ITEM(up, 0)))
        return 0;
    double t = PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(up, 0));
    if (t > *p) /* as `up[0] > la` compares: a NaN is never later */
        *p = t;
    return 1;
}

/* put(block, priority): block a leaf at priority (re-scored if it is one) */
static PyObject *
LeafOrder_put(LeafOrder *o, PyObject *const *args, Py_ssize_t nargs)
{
    double p;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "put(block, priority)");
        return NULL;
    }
    if (leaf_block_arg(args[0]) < 0 || leaf_prio_arg(args[1], &p) < 0 || lo_put(o, BLOCK(args[0]), p) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* drop(block): block no leaf here (nothing if it is none) */
static PyObject *
LeafOrder_drop(LeafOrder *o, PyObject *block)
{
    if (IS_BLOCK(block) && lo_drop(o, BLOCK(block)) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* holds(block) -> bool */
static PyObject *
LeafOrder_holds(LeafOrder *o, PyObject *block)
{
    double p;
    return PyBool_FromLong(IS_BLOCK(block) && lo_get(o, BLOCK(block), &p));
}

/* get(block, default=None): its priority */
static PyObject *
LeafOrder_get(LeafOrder *o, PyObject *const *args, Py_ssize_t nargs)
{
    double p;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(block, default=None)");
        return NULL;
    }
    if (IS_BLOCK(args[0]) && lo_get(o, BLOCK(args[0]), &p))
        return PyFloat_FromDouble(p);
    return Py_NewRef(nargs == 2 ? args[1] : Py_None);
}

static PyObject *
leaf_entry_tuple(const LeafEntry *e)
{
    PyObject *p = PyFloat_FromDouble(e->prio), *k = PyLong_FromUnsignedLongLong(e->key);
    PyObject *t = p != NULL && k != NULL ? PyTuple_Pack(3, p, k, (PyObject *)e->block) : NULL;
    Py_XDECREF(p);
    Py_XDECREF(k);
    return t;
}

/* part(after, n) -> list: up to n entries (priority, key, block) in order, those above `after`
 * ((priority, key), or None: from the first); copy_steps' cursor by value */
static PyObject *
LeafOrder_part(LeafOrder *o, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "part(after: tuple[float, int] | None, n: int)");
        return NULL;
    }
    Py_ssize_t n = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "part: n must be >= 0");
        return NULL;
    }
    Py_ssize_t i = 0, j = 0;
    if (args[0] != Py_None) {
        double p;
        uint64_t k;
        if (!PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 2) {
            PyErr_SetString(PyExc_TypeError, "part: after is None or (priority, key)");
            return NULL;
        }
        if (leaf_prio_arg(PyTuple_GET_ITEM(args[0], 0), &p) < 0 || t_key_strict(PyTuple_GET_ITEM(args[0], 1), &k) < 0)
            return NULL;
        i = lo_run_at(o, p, k, 1);
        j = i < o->nruns ? run_at(&o->runs[i], p, k, 1) : 0;
    }
    /* the entries first, their objects after: making objects may run a collection, whose
     * finalizers could change the order meanwhile */
    Py_ssize_t count = 0;
    for (Py_ssize_t a = i, b = j; a < o->nruns && count < n; a++, b = 0)
        count += Py_MIN(o->runs[a].len - b, n - count);
    LeafEntry *snap = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(LeafEntry));
    if (snap == NULL)
        return PyErr_NoMemory();
    Py_ssize_t got = 0;
    for (; i < o->nruns && got < count; i++, j = 0) {
        Py_ssize_t take = Py_MIN(o->runs[i].len - j, count - got);
        memcpy(&snap[got], &o->runs[i].e[j], (size_t)take * sizeof(LeafEntry));
        got += take;
    }
    for (Py_ssize_t a = 0; a < count; a++)
        Py_INCREF(snap[a].block);
    PyObject *out = PyList_New(count);
    for (Py_ssize_t a = 0; a < count && out != NULL; a++) {
        PyObject *t = leaf_entry_tuple(&snap[a]);
        if (t == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, a, t);
    }
    for (Py_ssize_t a = 0; a < count; a++)
        Py_DECREF(snap[a].block);
    PyMem_Free(snap);
    return out;
}

static PyObject *
LeafOrder_clear(LeafOrder *o, PyObject *unused)
{
    if (lo_clear(o) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
LeafOrder_sizeof(LeafOrder *o, PyObject *unused)
{
    size_t bytes = sizeof(LeafOrder) + us_bytes(&o->where) + (size_t)o->runs_cap * sizeof(LeafRun);
    for (Py_ssize_t i = 0; i < o->nruns; i++)
        bytes += (size_t)o->runs[i].cap * sizeof(LeafEntry);
    return PyLong_FromSize_t(bytes);
}

/* growth_pending: leaves whose table entries a growth has still to move (0 when not growing) */
static PyObject *
LeafOrder_growth_pending(LeafOrder *o, void *unused)
{
    return PyLong_FromSsize_t(o->where.old.size);
}

static PyGetSetDef LeafOrder_getset[] = {
    {"growth_pending", (getter)LeafOrder_growth_pending, NULL,
     "leaves still to move out of the smaller table while it grows (0: not growing)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* Whether slot `slot` (its bit `bit`, an int, for slots past 63) holds b: 1, 0, or -1. Holders
 * are an int (Block's setter), read without running Python code. */
static inline int
leaf_held(BlockObject *b, int slot, PyObject *bit)
{
    PyObject *holders = b->state->holders;
    if (slot < 64)
        return (int)((PyLong_AsUnsignedLongLongMask(holders) >> slot) & 1); /* its low 64 bits */
    PyObject *held = PyNumber_And(holders, bit);
    if (held == NULL)
        return -1;
    int r = PyObject_IsTrue(held);
    Py_DECREF(held);
    return r;
}

/* Whether b is a leaf of the slot: held, and no child held (held_child_other_than(b, bit, None)) */
static int
leaf_is_leaf(BlockObject *b, int slot, PyObject *bit)
{
    int r = leaf_held(b, slot, bit);
    if (r <= 0)
        return r;
    PyObject *c = b->children;
    if (c == Py_None)
        return 1;
    if (IS_BLOCK(c))
        return (r = leaf_held(BLOCK(c), slot, bit)) < 0 ? -1 : !r;
    Py_ssize_t pos = 0;
    PyObject *k, *child;
    while (PyDict_Next(c, &pos, &k, &child)) { /* runs no Python code: nothing changes the dict */
        if (!IS_BLOCK(child)) {
            PyErr_SetString(PyExc_TypeError, "a native Block's children are native Blocks");
            return -1;
        }
        if ((r = leaf_held(BLOCK(child), slot, bit)) != 0)
            return r < 0 ? -1 : 0;
    }
    return 1;
}

/* accessed(index, slot, block, priority): a Route reused the slot's chain ending at block; a
 * leaf here is re-scored at priority(index, block, slot) (SortedLeaves.accessed; PyLeafOrder's
 * is the reference), RadixIndex.recency without the call where leaf_recency can answer */
static PyObject *
LeafOrder_accessed(LeafOrder *o, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "accessed(index, slot, block, priority)");
        return NULL;
    }
    PyObject *index = args[0], *slotobj = args[1], *block = args[2], *priority = args[3];
    double p;
    if (!IS_BLOCK(block) || !lo_get(o, BLOCK(block), &p))
        Py_RETURN_NONE; /* no leaf here, as holds() answers */
    BlockObject *b = (BlockObject *)Py_NewRef(block); /* the priority is Python code */
    PyObject *pending = NULL, *bit = NULL;
    int overflow = 0, r = 0;
    long long slot = PyLong_CheckExact(slotobj) ? PyLong_AsLongLongAndOverflow(slotobj, &overflow) : -1;
    if (priority == leaf_recency_ref && !overflow && slot >= 0 && slot <= INT_MAX) {
        int leaf = slot < 64 || (bit = PyNumber_Lshift(one, slotobj)) != NULL ? leaf_is_leaf(b, (int)slot, bit) : -1;
        r = leaf < 0 ? -1 : leaf_recency(index, b, slotobj, leaf, &pending, &p);
    }
    if (r == 0) {
        PyObject *call[3] = {index, block, slotobj};
        PyObject *prio = PyObject_Vectorcall(priority, call, 3, NULL);
        r = prio == NULL ? -1 : leaf_prio_arg(prio, &p);
        Py_XDECREF(prio);
    }
    Py_XDECREF(pending);
    Py_XDECREF(bit);
    r = r < 0 ? -1 : lo_put(o, b, p);
    Py_DECREF(b);
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* stored(index, slot, blocks, priority): the leaf tracker's hook for a chain the slot just stored
 * (SortedLeaves.stored; PyLeafOrder.stored is the reference). A block the chain continues from
 * (its successor is its child) has a held child now: dropped. The chain's parent, its last block
 * and any block it does not continue from become leaves at priority(index, block, slot) if they
 * are leaves, else are dropped. */
static int lo_stored(LeafOrder *o, PyObject *index, PyObject *slotobj, PyObject *blocks, PyObject *priority,
                     BlockState *fresh);

static PyObject *
LeafOrder_stored(LeafOrder *o, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "stored(index, slot, blocks, priority)");
        return NULL;
    }
    return lo_stored(o, args[0], args[1], args[2], args[3], NULL) < 0 ? NULL : Py_NewRef(Py_None);
}

/* LeafOrder.stored's work (BlockTable.store_events calls it per event too): 0, or -1. A block
 * whose state is `fresh` (not NULL) was made by the store this hook follows, so it was never a
 * leaf here: dropping it would only probe for it (most of a chain's blocks are such). */
static int
lo_stored(LeafOrder *o, PyObject *index, PyObject *slotobj, PyObject *blocks, PyObject *priority, BlockState *fresh)
{
    int overflow;
    long slot = PyLong_Check(slotobj) ? PyLong_AsLongAndOverflow(slotobj, &overflow) : -1;
    if (slot < 0 || overflow) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "stored: slot is an int >= 0");
        return -1;
    }
    PyObject *seq = PySequence_Fast(blocks, "stored: blocks is a sequence of Blocks");
    if (seq == NULL)
        return -1;
    /* our own references to the blocks: the priority is Python code, which could change the list */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), nends = 0;
    BlockObject *stack[2 * 64 + 1], **items = stack;
    PyObject *bit = NULL, *pending = NULL; /* index._pending, once read (leaf_recency) */
    int result = -1;
    BlockObject *parent = NULL; /* the chain's parent, if a Block: ours too */
    if (n > 64 && (items = PyMem_Malloc((size_t)(2 * n + 1) * sizeof(BlockObject *))) == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    BlockObject **ends = items + n; /* the parent (if a Block) and the ends, borrowed from items */
    Py_ssize_t owned = 0;
    for (; owned < n; owned++) {
        PyObject *b = PySequence_Fast_GET_ITEM(seq, owned);
        if (leaf_block_arg(b) < 0)
            goto done;
        items[owned] = (BlockObject *)Py_NewRef(b);
    }
    if (n == 0) {
        result = 0;
        goto done;
    }
    if (slot >= 64) {
        if ((bit = PyNumber_Lshift(one, slotobj)) == NULL)
            goto done;
    }
    if (IS_BLOCK(items[0]->parent))
        ends[nends++] = parent = (BlockObject *)Py_NewRef(items[0]->parent);
    for (Py_ssize_t i = 0; i < n && i < STORE_AHEAD; i++)
        if (items[i]->state != fresh)
            us_prefetch(&o->where, leaf_addr(items[i]));
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + STORE_AHEAD < n && items[i + STORE_AHEAD]->state != fresh)
            us_prefetch(&o->where, leaf_addr(items[i + STORE_AHEAD]));
        if (i + 1 < n && items[i + 1]->parent == (PyObject *)items[i]) {
            if (items[i]->state != fresh && lo_drop(o, items[i]) < 0)
                goto done;
        }
        else
            ends[nends++] = items[i];
    }
    for (Py_ssize_t i = 0; i < nends; i++) {
        BlockObject *b = ends[i];
        int leaf = leaf_is_leaf(b, (int)slot, bit);
        if (leaf < 0)
            goto done;
        if (!leaf) {
            if (lo_drop(o, b) < 0)
                goto done;
            continue;
        }
        double p;
        int r = priority == leaf_recency_ref ? leaf_recency(index, b, slotobj, 1, &pending, &p) : 0;
        if (r == 0) {
            PyObject *call[3] = {index, (PyObject *)b, slotobj};
            PyObject *prio = PyObject_Vectorcall(priority, call, 3, NULL);
            r = prio == NULL ? -1 : leaf_prio_arg(prio, &p);
            Py_XDECREF(prio);
        }
        if (r < 0 || lo_put(o, b, p) < 0)
            goto done;
    }
    result = 0;
done:
    Py_XDECREF(bit);
    Py_XDECREF(pending);
    Py_XDECREF(parent);
    for (Py_ssize_t i = 0; i < owned; i++)
        Py_DECREF(items[i]);
    if (items != stack)
        PyMem_Free(items);
    Py_DECREF(seq);
    return result;
}

/* ---- its iterator: (priority, key, block) in order; a change to the order meanwhile raises */
typedef struct {
    PyObject_HEAD
    LeafOrder *order; /* NULL once exhausted */
    Py_ssize_t run, pos;
    uint64_t version;
} LeafOrderIter;

static PyObject *
LeafOrder_iter(LeafOrder *o)
{
    LeafOrderIter *it = PyObject_New(LeafOrderIter, &LeafOrderIterType);
    if (it == NULL)
        return NULL;
    it->order = (LeafOrder *)Py_NewRef(o);
    it->run = it->pos = 0;
    it->version = o->version;
    return (PyObject *)it;
}

static void
LeafOrderIter_dealloc(LeafOrderIter *it)
{
    Py_XDECREF(it->order);
    PyObject_Free(it);
}

static PyObject *
LeafOrderIter_next(LeafOrderIter *it)
{
    LeafOrder *o = it->order;
    if (o == NULL)
        return NULL;
    if (o->version != it->version) {
        PyErr_SetString(PyExc_RuntimeError, "LeafOrder changed during iteration");
        return NULL;
    }
    if (it->run >= o->nruns) {
        Py_CLEAR(it->order);
        return NULL;
    }
    const LeafRun *r = &o->runs[it->run];
    PyObject *t = leaf_entry_tuple(&r->e[it->pos]);
    if (t != NULL && ++it->pos == r->len) {
        it->run++;
        it->pos = 0;
    }
    return t;
}

static PyTypeObject LeafOrderIterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvrouterd.index._native._LeafOrderIterator",
    .tp_basicsize = sizeof(LeafOrderIter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)LeafOrderIter_dealloc,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)LeafOrderIter_next,
};

static PyMethodDef LeafOrder_methods[] = {
    {"put", (PyCFunction)(void (*)(void))LeafOrder_put, METH_FASTCALL,
     "put(block, priority): block is a leaf at priority (a real number; re-scored if it was one)"},
    {"drop", (PyCFunction)LeafOrder_drop, METH_O, "drop(block): block is no leaf (nothing if it was none)"},
    {"holds", (PyCFunction)LeafOrder_holds, METH_O, "holds(block) -> bool: whether block is a leaf here"},
    {"accessed", (PyCFunction)(void (*)(void))LeafOrder_accessed, METH_FASTCALL,
     "accessed(index, slot, block, priority): a leaf here re-scored at priority(index, block, slot)"},
    {"get", (PyCFunction)(void (*)(void))LeafOrder_get, METH_FASTCALL, "get(block, default=None): its priority"},
    {"part", (PyCFunction)(void (*)(void))LeafOrder_part, METH_FASTCALL,
     "part(after, n) -> list: up to n entries (priority, key, block) above after ((priority, key) or None)"},
    {"stored", (PyCFunction)(void (*)(void))LeafOrder_stored, METH_FASTCALL,
     "stored(index, slot, blocks, priority): the leaf tracker's hook for a stored chain"},
    {"clear", (PyCFunction)LeafOrder_clear, METH_NOARGS, "drop every leaf"},
    {"__sizeof__", (PyCFunction)LeafOrder_sizeof, METH_NOARGS, "bytes used, its tables included (not the blocks)"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods LeafOrder_as_sequence = {
    .sq_length = (lenfunc)LeafOrder_len,
};

static PyTypeObject LeafOrderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvrouterd.index._native.LeafOrder",
    .tp_doc = "LeafOrder(): a worker slot's leaves (native Blocks) sorted by (priority: float, key).",
    .tp_basicsize = sizeof(LeafOrder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = LeafOrder_new,
    .tp_dealloc = (destructor)LeafOrder_dealloc,
    .tp_as_sequence = &LeafOrder_as_sequence,
    .tp_iter = (getiterfunc)LeafOrder_iter,
    .tp_methods = LeafOrder_methods,
    .tp_getset = LeafOrder_getset,
};

static PyObject *slot_name; /* interned "slot" */

/* Where instances of `type` hold attribute `name` as a plain `__slots__` member (an object
 * pointer at a fixed offset, what Worker's `slot` and load fields are), that offset; else -1.
 * Generic attribute lookup finds such a data descriptor before any instance dict, so reading the
 * pointer is exactly what PyObject_GetAttr returns (NULL where it raises AttributeError), at a
 * tenth of the cost: no type-cache lookup, descriptor call and reference dance per read. */
static Py_ssize_t
member_offset(PyTypeObject *type, PyObject *name)
{
    if (type->tp_getattro != PyObject_GenericGetAttr)
        return -1;
    PyObject *descr = _PyType_Lookup(type, name); /* borrowed */
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type))
        return -1;
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != T_OBJECT_EX || (member->flags & PY_AUDIT_READ))
        return -1;
    return member->offset;
}

/* obj.<name>, a new reference: through the member at `offset` when it is >= 0 and set, else the
 * generic lookup (which also raises the AttributeError of an unset member). */
static inline PyObject *
member_get(PyObject *obj, Py_ssize_t offset, PyObject *name)
{
    if (offset >= 0) {
        PyObject *value = *(PyObject **)((char *)obj + offset);
        if (value != NULL)
            return Py_NewRef(value);
    }
    return PyObject_GetAttr(obj, name);
}

/* Where a class keeps an attribute the native passes read on the router's own Python objects
 * (the deadline guard, the ledger, the worker registry: classes with __slots__), found once per
 * class, name and version of the class (member_offset) and kept in a small direct-mapped cache:
 * read through the generic lookup, each was ~190 instructions, ~30 of them a Route + Complete.
 * A class without such a member (or without a valid version tag) is read the generic way. The
 * cache holds its classes (a strong reference), so an address is never another class's. */
typedef struct {
    PyTypeObject *type;
    PyObject *name; /* an interned name of this module's, alive as long as it is */
    unsigned int tag;
    Py_ssize_t at;
} AttrPlace;
#define ATTR_PLACES 128
static AttrPlace attr_places[ATTR_PLACES];

/* the member offset of obj.<name>, or -1 (read it the generic way) */
static inline Py_ssize_t
attr_place(PyObject *obj, PyObject *name)
{
    PyTypeObject *type = Py_TYPE(obj);
    if (!PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG))
        return member_offset(type, name);
    AttrPlace *p = &attr_places[(((uintptr_t)type >> 4) * 31 + ((uintptr_t)name >> 4)) & (ATTR_PLACES - 1)];
    if (p->type != type || p->name != name || p->tag != type->tp_version_tag) {
        p->at = member_offset(type, name);
        Py_XSETREF(p->type, (PyTypeObject *)Py_NewRef(type));
        p->name = name;
        p->tag = type->tp_version_tag;
    }
    return p->at;
}

/* obj.<name> (a new reference), through its member where its class has one */
static inline PyObject *
attr_get(PyObject *obj, PyObject *name)
{
    return member_get(obj, attr_place(obj, name), name);
}

/* obj.<name> = value (value not NULL): 0, or -1 with an error */
static inline int
attr_set(PyObject *obj, PyObject *name, PyObject *value)
{
    Py_ssize_t at = attr_place(obj, name);
    if (at < 0)
        return PyObject_SetAttr(obj, name, value);
    Py_XSETREF(*(PyObject **)((char *)obj + at), Py_NewRef(value)); /* a __slots__ member's own store */
    return 0;
}

/* The exact int `v` as a long long into *out: 0, or 1 when it does not fit. A candidate's slot
 * and load are nearly always one digit, read here without a call (a third of the scan's time
 * over 1,024 candidates went to the three conversions). */
static inline int
exact_long(PyObject *v, long long *out)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (_PyLong_IsCompact((PyLongObject *)v)) {
        *out = (long long)_PyLong_CompactValue((PyLongObject *)v);
        return 0;
    }
#else
    Py_ssize_t size = Py_SIZE(v); /* digits, negative for a negative int; 0 has digit[0] == 0 */
    if (size >= -1 && size <= 1) {
        *out = size * (long long)((PyLongObject *)v)->ob_digit[0];
        return 0;
    }
#endif
    int overflow;
    *out = PyLong_AsLongLongAndOverflow(v, &overflow);
    return overflow;
}

/* ---- SlotLoads: every worker's committed load, by slot ---------------------------------------
 *
 * What the router has committed to each worker (in-flight requests, pending prefill tokens) in
 * one int64 array per column, indexed by the worker's index slot. It is the only copy: Worker's
 * `inflight_requests` and `pending_prefill_tokens` are SlotLoad descriptors reading and writing
 * it through the worker's `slot` and `slot_loads` members (index/workers.py), so the candidate
 * scan reads a candidate's load by slot from one small array instead of from each Worker object
 * (prefix_scan below: over 1,024 workers the Workers' scattered memory was most of its time).
 * A slot past the array's end holds 0; writing there grows it. */
#define LOAD_COLUMNS 2
/* slots a store may hold: far above any worker slot (MAX_WORKERS is 4,096, a few more while old
 * slots drain), so a runaway slot number is an error rather than a huge allocation */
#define SLOT_LOADS_MAX (1 << 20)

typedef struct {
    PyObject_HEAD
    Py_ssize_t capacity; /* slots per column */
    int64_t *values;     /* column c, slot s: values[c * capacity + s] */
} SlotLoadsObject;

static PyTypeObject SlotLoadsType;

static PyObject *
SlotLoads_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_Format(PyExc_TypeError, "%.100s() takes no arguments", type->tp_name);
        return NULL;
    }
    return type->tp_alloc(type, 0); /* zeroed: no slot yet */
}

static void
SlotLoads_dealloc(SlotLoadsObject *s)
{
    PyMem_Free(s->values);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* the load in `column` of `slot`, 0 for a slot past the end */
static inline int64_t
slot_load(const SlotLoadsObject *s, int column, long long slot)
{
    return slot >= 0 && slot < s->capacity ? s->values[column * s->capacity + slot] : 0;
}

/* room for `slot` (0 <= slot < SLOT_LOADS_MAX, checked by the caller): 0, or -1 with MemoryError */
static int
slot_loads_reserve(SlotLoadsObject *s, Py_ssize_t slot)
{
    if (slot < s->capacity)
        return 0;
    Py_ssize_t capacity = s->capacity ? s->capacity : 64;
    while (capacity <= slot)
        capacity *= 2;
    int64_t *values = PyMem_Calloc((size_t)(capacity * LOAD_COLUMNS), sizeof(int64_t));
    if (values == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int c = 0; c < LOAD_COLUMNS && s->capacity; c++)
        memcpy(values + c * capacity, s->values + c * s->capacity, (size_t)s->capacity * sizeof(int64_t));
    PyMem_Free(s->values);
    s->values = values;
    s->capacity = capacity;
    return 0;
}

/* a slot number argument: 0 <= slot < SLOT_LOADS_MAX, else -1 with ValueError (or the int's error) */
static Py_ssize_t
slot_arg(PyObject *obj)
{
    Py_ssize_t slot = PyNumber_AsSsize_t(obj, PyExc_OverflowError);
    if (slot == -1 && PyErr_Occurred())
        return -1;
    if (slot < 0 || slot >= SLOT_LOADS_MAX) {
        PyErr_Format(PyExc_ValueError, "slot must be in [0, %d), got %zd", SLOT_LOADS_MAX, slot);
        return -1;
    }
    return slot;
}

/* move(old, new): slot `new` takes `old`'s loads and `old` is left with none (a worker moved to a
 * fresh slot, WorkerRegistry.move) */
static PyObject *
SlotLoads_move(SlotLoadsObject *s, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "move(old, new) takes 2 arguments");
        return NULL;
    }
    Py_ssize_t old = slot_arg(args[0]), new = old < 0 ? -1 : slot_arg(args[1]);
    if (new < 0 || slot_loads_reserve(s, old > new ? old : new) < 0)
        return NULL;
    for (int c = 0; c < LOAD_COLUMNS; c++) {
        int64_t *column = s->values + c * s->capacity;
        column[new] = column[old];
        if (new != old)
            column[old] = 0;
    }
    Py_RETURN_NONE;
}

/* detach(slot) -> SlotLoads: a new store holding `slot`'s loads (at the same slot), which this
 * one forgets: a worker leaving the registry keeps what it had, and its slot's next worker
 * starts from none (WorkerRegistry.remove) */
static PyObject *
SlotLoads_detach(SlotLoadsObject *s, PyObject *arg)
{
    Py_ssize_t slot = slot_arg(arg);
    if (slot < 0)
        return NULL;
    SlotLoadsObject *own = PyObject_New(SlotLoadsObject, &SlotLoadsType);
    if (own != NULL) {
        own->capacity = 0;
        own->values = NULL;
    }
    if (own == NULL || slot_loads_reserve(own, slot) < 0) {
        Py_XDECREF(own);
        return NULL;
    }
    for (int c = 0; c < LOAD_COLUMNS && slot < s->capacity; c++) {
        own->values[c * own->capacity + slot] = s->values[c * s->capacity + slot];
        s->values[c * s->capacity + slot] = 0;
    }
    return (PyObject *)own;
}

/* get(column, slot) -> int */
static PyObject *
SlotLoads_get(SlotLoadsObject *s, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "get(column, slot) takes 2 arguments");
        return NULL;
    }
    long column = PyLong_AsLong(args[0]);
    if (column == -1 && PyErr_Occurred())
        return NULL;
    if (column < 0 || column >= LOAD_COLUMNS) {
        PyErr_Format(PyExc_ValueError, "column must be in [0, %d)", LOAD_COLUMNS);
        return NULL;
    }
    Py_ssize_t slot = slot_arg(args[1]);
    return slot < 0 ? NULL : PyLong_FromLongLong(slot_load(s, (int)column, slot));
}

static PyMethodDef SlotLoads_methods[] = {
    {"move", (PyCFunction)(void (*)(void))SlotLoads_move, METH_FASTCALL,
     "move(old, new): slot new takes old's loads, old is left with none"},
    {"detach", (PyCFunction)SlotLoads_detach, METH_O,
     "detach(slot) -> SlotLoads: a new store holding slot's loads, which this one forgets"},
    {"get", (PyCFunction)(void (*)(void))SlotLoads_get, METH_FASTCALL, "get(column, slot) -> int: 0 if never set"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SlotLoadsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvrouterd.index._native.SlotLoads",
    .tp_doc = "SlotLoads(): every worker's committed load (in-flight requests, pending prefill tokens) by slot.",
    .tp_basicsize = sizeof(SlotLoadsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = SlotLoads_new,
    .tp_dealloc = (destructor)SlotLoads_dealloc,
    .tp_methods = SlotLoads_methods,
};

/* ---- SlotLoad: a worker's load attribute, kept in its SlotLoads -------------------------------
 *
 * SlotLoad(column): a data descriptor for a class with `__slots__` members `slot` (an int) and
 * `slot_loads` (a SlotLoads); `obj.attr` is obj.slot_loads's load in `column` at obj.slot, and
 * assigning an int of at most 64 bits writes it there. Read as fast as a plain member (the
 * member offsets are found once per class), so Python code reading a worker's load costs what
 * it did. */
static PyObject *slot_loads_name; /* interned "slot_loads" */

typedef struct {
    PyObject_HEAD
    int column;
    PyTypeObject *type;               /* the class whose offsets follow (a reference), or NULL */
    Py_ssize_t slot_at, loads_at;     /* its members' offsets */
} SlotLoadObject;

static PyTypeObject SlotLoadType;

static PyObject *
SlotLoad_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"column", NULL};
    int column;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i:SlotLoad", kwlist, &column))
        return NULL;
    if (column < 0 || column >= LOAD_COLUMNS) {
        PyErr_Format(PyExc_ValueError, "column must be in [0, %d)", LOAD_COLUMNS);
        return NULL;
    }
    SlotLoadObject *d = (SlotLoadObject *)type->tp_alloc(type, 0);
    if (d != NULL) {
        d->column = column;
        d->type = NULL;
    }
    return (PyObject *)d;
}

static void
SlotLoad_dealloc(SlotLoadObject *d)
{
    Py_XDECREF(d->type);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

static Py_ssize_t member_offset(PyTypeObject *type, PyObject *name);

/* obj's store (borrowed) and slot into *slot; NULL with an error when obj lacks either member
 * or they hold anything else */
static SlotLoadsObject *
slot_load_target(SlotLoadObject *d, PyObject *obj, long long *slot)
{
    PyTypeObject *type = Py_TYPE(obj);
    if (d->type != type) {
        Py_ssize_t slot_at = member_offset(type, slot_name), loads_at = member_offset(type, slot_loads_name);
        if (slot_at < 0 || loads_at < 0) {
            PyErr_Format(PyExc_TypeError, "SlotLoad needs __slots__ members 'slot' and 'slot_loads' in %s",
                         type->tp_name);
            return NULL;
        }
        Py_INCREF(type);
        Py_XSETREF(d->type, type);
        d->slot_at = slot_at;
        d->loads_at = loads_at;
    }
    PyObject *s = *(PyObject **)((char *)obj + d->slot_at);
    PyObject *loads = *(PyObject **)((char *)obj + d->loads_at);
    if (s == NULL || loads == NULL) {
        PyErr_SetString(PyExc_AttributeError, "a load read before the worker's slot and slot_loads are set");
        return NULL;
    }
    if (!PyLong_CheckExact(s) || !Py_IS_TYPE(loads, &SlotLoadsType)) {
        PyErr_SetString(PyExc_TypeError, "a worker's slot must be an int and its slot_loads a SlotLoads");
        return NULL;
    }
    if (exact_long(s, slot) || *slot < 0 || *slot >= SLOT_LOADS_MAX) {
        PyErr_Format(PyExc_ValueError, "slot must be in [0, %d)", SLOT_LOADS_MAX);
        return NULL;
    }
    return (SlotLoadsObject *)loads;
}

static PyObject *
SlotLoad_get(SlotLoadObject *d, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(d);
    long long slot;
    SlotLoadsObject *loads = slot_load_target(d, obj, &slot);
    return loads == NULL ? NULL : PyLong_FromLongLong(slot_load(loads, d->column, slot));
}

static int
SlotLoad_set(SlotLoadObject *d, PyObject *obj, PyObject *value)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "a worker's load cannot be deleted");
        return -1;
    }
    if (!PyLong_Check(value)) { /* an int only, as the scan reads it: not a float, not __index__ */
        PyErr_Format(PyExc_TypeError, "a worker's load must be an int, got %s", Py_TYPE(value)->tp_name);
        return -1;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred())
        return -1;
    long long slot;
    SlotLoadsObject *loads = slot_load_target(d, obj, &slot);
    if (loads == NULL || slot_loads_reserve(loads, (Py_ssize_t)slot) < 0)
        return -1;
    loads->values[d->column * loads->capacity + slot] = v;
    return 0;
}

static PyTypeObject SlotLoadType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvrouterd.index._native.SlotLoad",
    .tp_doc = "SlotLoad(column): a worker's load attribute, kept in its slot_loads (a SlotLoads) at its slot.",
    .tp_basicsize = sizeof(SlotLoadObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = SlotLoad_new,
    .tp_dealloc = (destructor)SlotLoad_dealloc,
    .tp_descr_get = (descrgetfunc)SlotLoad_get,
    .tp_descr_set = (descrsetfunc)SlotLoad_set,
};

/* The depth of the candidate in slot `slot` (an exact int) into *depth: from the walk's Overlaps
 * `by_slot` when not NULL, else looked up in the dict `overlaps` (0 when absent). 0; 1 when the
 * dict's value is not an int of at most 64 bits (the caller runs the reference); -1 on error. */
static inline int
scan_depth(PyObject *overlaps, OverlapsObject *by_slot, PyObject *slot, long long *depth)
{
    int overflow;
    *depth = 0;
    if (by_slot != NULL) {
        long long s;
        *depth = exact_long(slot, &s) ? 0 : overlaps_depth(by_slot, s);
        return 0;
    }
    PyObject *found = PyDict_GetItemWithError(overlaps, slot); /* borrowed */
    if (found == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyLong_CheckExact(found))
        return 1;
    *depth = PyLong_AsLongLongAndOverflow(found, &overflow);
    return overflow ? 1 : 0;
}

/* Where the candidates' class last read (scan_item; type NULL for none) keeps a candidate's slot
 * and load: plain members (load_at), or a SlotLoad descriptor over the `slot_loads` member
 * (loads_at, column: Worker's, where the extension is built); -1 for neither. */
typedef struct {
    PyTypeObject *type;
    Py_ssize_t slot_at, load_at, loads_at;
    int column;
} ScanMembers;

static void
scan_members(ScanMembers *members, PyTypeObject *type, PyObject *load_name)
{
    members->type = type;
    members->slot_at = member_offset(type, slot_name);
    members->load_at = member_offset(type, load_name);
    members->loads_at = -1;
    members->column = 0;
    if (members->load_at < 0 && type->tp_getattro == PyObject_GenericGetAttr) {
        /* a data descriptor is what the generic lookup reads, before any instance dict */
        PyObject *descr = _PyType_Lookup(type, load_name); /* borrowed */
        if (descr != NULL && Py_IS_TYPE(descr, &SlotLoadType)) {
            members->loads_at = member_offset(type, slot_loads_name);
            members->column = ((SlotLoadObject *)descr)->column;
        }
    }
}

/* The slot of `item` (its `slot` member at slot_at, known >= 0) as SlotLoad reads it, and its
 * load in `loads` (its member at loads_at): 0; 1 when either is not what SlotLoad reads without
 * an error (the caller reads the attribute, which raises it). No reference is taken. */
static inline int
slot_member_load(PyObject *item, const ScanMembers *members, long long *slot, long long *load)
{
    PyObject *s = *(PyObject **)((char *)item + members->slot_at);
    PyObject *loads = *(PyObject **)((char *)item + members->loads_at);
    if (s == NULL || loads == NULL || !PyLong_CheckExact(s) || !Py_IS_TYPE(loads, &SlotLoadsType)
        || exact_long(s, slot) || *slot < 0 || *slot >= SLOT_LOADS_MAX)
        return 1;
    *load = slot_load((SlotLoadsObject *)loads, members->column, *slot);
    return 0;
}

/* scan_item's way for anything but plain members over the walk's Overlaps: through references,
 * as Python code may run (a property, a dict key's __eq__), so `members` is forgotten after (its
 * class may be gone and another allocated in its place) and the caller re-reads its items. */
static int
scan_item_generic(PyObject *item, PyObject *overlaps, OverlapsObject *by_slot, PyObject *load_name,
                  ScanMembers *members, long long *depth, long long *load)
{
    Py_ssize_t slot_at = members->slot_at, load_at = members->load_at;
    members->type = NULL;
    Py_INCREF(item); /* a getter run on it may drop the sequence's reference */
    int result = 1;
    PyObject *slot = member_get(item, slot_at, slot_name);
    if (slot == NULL) {
        result = -1;
        goto done;
    }
    if (!PyLong_CheckExact(slot)) { /* its __hash__/__eq__ could run Python code */
        Py_DECREF(slot);
        goto done;
    }
    int got = scan_depth(overlaps, by_slot, slot, depth);
    Py_DECREF(slot);
    if (got != 0) {
        result = got;
        goto done;
    }
    PyObject *load_obj = member_get(item, load_at, load_name);
    if (load_obj == NULL) {
        result = -1;
        goto done;
    }
    if (PyLong_CheckExact(load_obj))
        result = exact_long(load_obj, load) ? 1 : 0;
    Py_DECREF(load_obj);
done:
    Py_DECREF(item);
    return result;
}

/* A candidate's cached prefix (overlaps[item.slot], 0 when absent) and load (item.<load_name>)
 * into *depth and *load, as prefix_scan and prefix_ties read them. 0; 1 when the caller runs the
 * Python reference (a slot that is not an int, a depth or load not an int of at most 64 bits);
 * -1 on error. `members` holds the member offsets of the class last read. */
static inline int
scan_item(PyObject *item, PyObject *overlaps, OverlapsObject *by_slot, PyObject *load_name, ScanMembers *members,
          long long *depth, long long *load)
{
    if (Py_TYPE(item) != members->type)
        scan_members(members, Py_TYPE(item), load_name);
    if (members->slot_at >= 0 && members->loads_at >= 0 && by_slot != NULL) {
        /* Worker, its load kept by slot (SlotLoad), over the walk's Overlaps */
        long long s;
        if (slot_member_load(item, members, &s, load) == 0) {
            *depth = overlaps_depth(by_slot, s);
            return 0;
        }
    }
    if (members->slot_at >= 0 && members->load_at >= 0 && by_slot != NULL) {
        /* Worker over the walk's Overlaps, nearly every call: both members are read in place,
         * without a reference, as nothing here can run Python code or free them */
        PyObject *slot = *(PyObject **)((char *)item + members->slot_at);
        PyObject *load_obj = *(PyObject **)((char *)item + members->load_at);
        if (slot != NULL && load_obj != NULL && PyLong_CheckExact(slot) && PyLong_CheckExact(load_obj)) {
            long long s;
            *depth = exact_long(slot, &s) ? 0 : overlaps_depth(by_slot, s);
            return exact_long(load_obj, load);
        }
    }
    return scan_item_generic(item, overlaps, by_slot, load_name, members, depth, load);
}

/* `overlaps` as the match walk's Overlaps (*by_slot) or a dict (*by_slot NULL); 0, or 1 when it
 * is neither (the caller runs the Python reference). */
static inline int
scan_overlaps(PyObject *overlaps, OverlapsObject **by_slot)
{
    *by_slot = Py_IS_TYPE(overlaps, &OverlapsType) ? (OverlapsObject *)overlaps : NULL;
    return *by_slot == NULL && !PyDict_Check(overlaps);
}

/* prefix_scan's running result: the longest prefix (ties to the lower load, then the first),
 * the first lowest load and the highest. It starts below any candidate (SCAN_START): the first
 * one sets all of it. */
typedef struct {
    Py_ssize_t best_i;
    long long best_depth, best_load;
    Py_ssize_t min_i;
    long long min_load, max_load;
} ScanBest;

#define SCAN_START {0, -1, 0, 0, LLONG_MAX, LLONG_MIN}

/* The lowest and highest load as conditional moves (the compiler's choice for the best, which
 * measured faster than masks that force one too). */
static inline void
scan_take(ScanBest *b, Py_ssize_t i, long long depth, long long load)
{
    int better = (depth > b->best_depth) | ((depth == b->best_depth) & (load < b->best_load));
    b->best_i = better ? i : b->best_i;
    b->best_depth = better ? depth : b->best_depth;
    b->best_load = better ? load : b->best_load;
    int lower = load < b->min_load;
    b->min_i = lower ? i : b->min_i;
    b->min_load = lower ? load : b->min_load;
    b->max_load = load > b->max_load ? load : b->max_load;
}

/* An int's value when it is one non-negative CPython digit (every worker slot below 2**30) into
 * *out: 1; else 0. */
static inline int
one_digit(PyObject *v, uint32_t *out)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (!_PyLong_IsCompact((PyLongObject *)v) || _PyLong_CompactValue((PyLongObject *)v) < 0)
        return 0;
    *out = (uint32_t)_PyLong_CompactValue((PyLongObject *)v);
#else
    Py_ssize_t size = Py_SIZE(v);
    if ((size_t)size > 1) /* negative, or two digits and more */
        return 0;
    *out = ((PyLongObject *)v)->ob_digit[0]; /* 0 is stored as one zero digit */
#endif
    return 1;
}

/* prefix_scan's run of Workers from items[i] on whose loads are kept by slot (SlotLoad, over one
 * SlotLoads) over the walk's Overlaps: each one's slot is read in place, its depth and load from
 * two arrays indexed by it. Everything but the slot is read once for the run: over 1,024 workers
 * the general read (scan_item) took ~50 instructions a candidate, this ~20. Returns the index of
 * the first item that is not such a Worker (n at the end). No reference is taken: nothing here
 * runs Python code. */
static Py_ssize_t
scan_slot_loads(PyObject **items, Py_ssize_t i, Py_ssize_t n, const ScanMembers *members, const OverlapsObject *by_slot,
                ScanBest *best)
{
    PyTypeObject *type = members->type;
    Py_ssize_t slot_at = members->slot_at, loads_at = members->loads_at;
    PyObject *loads = *(PyObject **)((char *)items[i] + loads_at);
    if (loads == NULL || !Py_IS_TYPE(loads, &SlotLoadsType))
        return i;
    const SlotLoadsObject *store = (const SlotLoadsObject *)loads;
    const int64_t *column = store->values + members->column * store->capacity;
    size_t capacity = (size_t)store->capacity, width = (size_t)by_slot->width;
    const uint32_t *depths = by_slot->data;
    ScanBest b = *best; /* in registers: through the pointer, every candidate waited on the last one's stores */
    for (; i < n; i++) {
        PyObject *item = items[i];
        if (Py_TYPE(item) != type || *(PyObject **)((char *)item + loads_at) != loads)
            break;
        PyObject *s = *(PyObject **)((char *)item + slot_at);
        uint32_t slot;
        if (s == NULL || !PyLong_CheckExact(s) || !one_digit(s, &slot))
            break;
        scan_take(&b, i, slot < width ? depths[slot] : 0, slot < capacity ? column[slot] : 0);
    }
    *best = b;
    return i;
}

/* ---- CandidateSlots: a candidate list's slots, read once per membership ------------------------
 *
 * CandidateSlots(candidates): the slot of each candidate (Workers whose load is kept by slot,
 * SlotLoad) as a uint32 array, with the SlotLoads they all share. The router's selector makes
 * one per eligible-worker list, when membership changes, and prefix_scan given it reads no Worker
 * at all: a candidate's depth and load are two arrays indexed by its slot (over 1,024 workers,
 * reading each Worker's slot int from its own memory was most of what the scan still cost). It
 * is a snapshot: valid while no candidate moves or leaves, which changes the registry's
 * generation, and so the list it was made from. It also maps each slot back to its candidate,
 * so the scan finds the longest prefix from the walk's deepest entries (scan_by_slots). */
typedef struct {
    PyObject_VAR_HEAD /* ob_size: the candidates */
    SlotLoadsObject *loads;
    PyTypeObject *cls;   /* the candidates' class */
    PyObject *load_name; /* the load attribute prefix_scan last read (a reference), or NULL */
    int column;          /* its column in `loads`, or -1: not a SlotLoad of cls */
    int32_t *index_of;   /* slot -> its candidate's index, -1 for none; NULL: a slot appears twice */
    uint32_t span;       /* index_of's length: the highest slot + 1 */
    uint32_t slots[1];
} CandidateSlotsObject;

static PyTypeObject CandidateSlotsType;

static PyObject *
CandidateSlots_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"candidates", NULL};
    PyObject *candidates;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:CandidateSlots", kwlist, &candidates))
        return NULL;
    PyObject *seq = PySequence_Fast(candidates, "candidates must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    CandidateSlotsObject *c = PyObject_NewVar(CandidateSlotsObject, type, n);
    if (c == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    c->loads = NULL;
    c->cls = NULL;
    c->load_name = NULL;
    c->column = -1;
    c->index_of = NULL;
    c->span = 0;
    PyTypeObject *cls = NULL;
    Py_ssize_t slot_at = -1, loads_at = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (cls == NULL) { /* one class: prefix_scan reads the load attribute of the first */
            cls = Py_TYPE(item);
            slot_at = member_offset(cls, slot_name);
            loads_at = member_offset(cls, slot_loads_name);
        }
        int same = Py_TYPE(item) == cls; /* the offsets are cls's */
        PyObject *s = !same || slot_at < 0 ? NULL : *(PyObject **)((char *)item + slot_at);
        PyObject *loads = !same || loads_at < 0 ? NULL : *(PyObject **)((char *)item + loads_at);
        uint32_t slot;
        if (s == NULL || loads == NULL || !PyLong_CheckExact(s) || !one_digit(s, &slot)
            || slot >= SLOT_LOADS_MAX
            || !Py_IS_TYPE(loads, &SlotLoadsType) || (c->loads != NULL && loads != (PyObject *)c->loads)) {
            PyErr_SetString(PyExc_ValueError, "candidates must be of one class, each with an int slot and one SlotLoads "
                            "in slot_loads");
            Py_DECREF(c);
            Py_DECREF(seq);
            return NULL;
        }
        if (c->loads == NULL)
            c->loads = (SlotLoadsObject *)Py_NewRef(loads);
        c->slots[i] = slot;
        c->span = slot + 1 > c->span ? slot + 1 : c->span;
    }
    c->cls = (PyTypeObject *)Py_XNewRef(cls);
    Py_DECREF(seq);
    if (n == 0)
        return (PyObject *)c;
    if ((c->index_of = PyMem_New(int32_t, c->span)) == NULL) {
        Py_DECREF(c);
        return PyErr_NoMemory();
    }
    memset(c->index_of, 0xff, (size_t)c->span * sizeof(int32_t)); /* -1: no candidate */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (c->index_of[c->slots[i]] >= 0) { /* a slot twice: the scan reads every candidate */
            PyMem_Free(c->index_of);
            c->index_of = NULL;
            break;
        }
        c->index_of[c->slots[i]] = (int32_t)i;
    }
    return (PyObject *)c;
}

static void
CandidateSlots_dealloc(CandidateSlotsObject *c)
{
    Py_XDECREF(c->loads);
    Py_XDECREF(c->cls);
    Py_XDECREF(c->load_name);
    PyMem_Free(c->index_of);
    PyObject_Free(c);
}

static Py_ssize_t
CandidateSlots_len(CandidateSlotsObject *c)
{
    return Py_SIZE(c);
}

static PySequenceMethods CandidateSlots_as_sequence = {
    .sq_length = (lenfunc)CandidateSlots_len,
};

static PyTypeObject CandidateSlotsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvrouterd.index._native.CandidateSlots",
    .tp_doc = "CandidateSlots(candidates): their slots and shared SlotLoads, for prefix_scan.",
    .tp_basicsize = offsetof(CandidateSlotsObject, slots),
    .tp_itemsize = sizeof(uint32_t),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = CandidateSlots_new,
    .tp_dealloc = (destructor)CandidateSlots_dealloc,
    .tp_as_sequence = &CandidateSlots_as_sequence,
};

/* Whether `c` answers for the candidates `seq` (not empty) over the walk's Overlaps `by_slot`
 * (NULL: a dict) with the load `load_name`: as many of them as it has, of the class it was made
 * from (the caller's promise covers the rest: made from this very list), and that load a SlotLoad
 * of the class; its column is then c->column. */
static int
candidate_slots_apply(CandidateSlotsObject *c, PyObject *seq, const OverlapsObject *by_slot, PyObject *load_name)
{
    if (by_slot == NULL || Py_SIZE(c) != PySequence_Fast_GET_SIZE(seq)
        || Py_TYPE(PySequence_Fast_GET_ITEM(seq, 0)) != c->cls)
        return 0;
    if (c->load_name != load_name) { /* the policy's load attribute, looked up once */
        ScanMembers members;
        scan_members(&members, c->cls, load_name);
        Py_XSETREF(c->load_name, Py_NewRef(load_name));
        c->column = members.loads_at >= 0 ? members.column : -1;
    }
    return c->column >= 0;
}

/* prefix_scan over a CandidateSlots: the candidates' depths and loads (`column`) read by slot,
 * no Worker touched.
 *
 * With each slot's candidate known (index_of), the longest prefix is found from the walk's
 * entries, which it made in order of depth: the deepest are last, and only those are read, so
 * the pass over every candidate is the loads' alone (1,024 candidates: ~30 instructions each
 * when each took its depth too and chained through the running best, now ~8). */
static void
scan_by_slots(const CandidateSlotsObject *c, const OverlapsObject *by_slot, int column, ScanBest *best)
{
    const SlotLoadsObject *store = c->loads;
    const int64_t *loads = store->values + column * store->capacity;
    size_t capacity = (size_t)store->capacity, width = (size_t)by_slot->width;
    const uint32_t *depths = by_slot->data;
    Py_ssize_t n = Py_SIZE(c);
    ScanBest b = *best; /* in registers: through the pointer, every candidate waited on the last one's stores */
    if (c->index_of == NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t slot = c->slots[i];
            scan_take(&b, i, slot < width ? depths[slot] : 0, slot < capacity ? loads[slot] : 0);
        }
        *best = b;
        return;
    }
    if (c->span <= capacity) {
        /* every slot within the store (the usual case): the lowest and highest load as two
         * independent chains, then the first candidate with the lowest, found from the front;
         * the first lowest kept in the one pass was a third chain (~14 instructions a candidate
         * over 1,024 workers, now ~8) */
        long long low = b.min_load, high = b.max_load;
        for (Py_ssize_t i = 0; i < n; i++) {
            long long load = loads[c->slots[i]];
            low = load < low ? load : low;
            high = load > high ? load : high;
        }
        Py_ssize_t i = 0;
        while (loads[c->slots[i]] != low) /* n >= 1: `low` is some candidate's */
            i++;
        b.min_i = i;
        b.min_load = low;
        b.max_load = high;
    }
    else {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t slot = c->slots[i];
            long long load = slot < capacity ? loads[slot] : 0;
            int lower = load < b.min_load;
            b.min_i = lower ? i : b.min_i;
            b.min_load = lower ? load : b.min_load;
            b.max_load = load > b.max_load ? load : b.max_load;
        }
    }
    /* the deepest candidates' entries, from the last: ties to the lower load, then the first */
    const uint32_t *order = by_slot->data + by_slot->width;
    long long top = 0;
    Py_ssize_t best_i = -1;
    long long best_load = 0;
    for (Py_ssize_t k = by_slot->count - 1; k >= 0; k--) {
        uint32_t slot = order[k];
        long long depth = depths[slot]; /* >= 1: a walk records no depth 0 */
        if (depth < top)
            break;
        Py_ssize_t i = slot < c->span ? c->index_of[slot] : -1;
        if (i < 0) /* the walk's mask held slots beyond these candidates */
            continue;
        long long load = slot < capacity ? loads[slot] : 0;
        if (best_i < 0 || load < best_load || (load == best_load && i < best_i)) {
            best_i = i;
            best_load = load;
        }
        top = depth;
    }
    if (best_i < 0) { /* no candidate holds a block: all tie at 0, the first least loaded wins */
        best_i = b.min_i;
        best_load = b.min_load;
    }
    b.best_i = best_i;
    b.best_depth = top;
    b.best_load = best_load;
    *best = b;
}

/* prefix_scan(candidates, overlaps, load_name) -> (best_i, best_depth, min_i, min_load, max_load)
 *
 * One pass over a routing decision's candidates, the reference being policies/_scan.py:
 * scan_candidates_py (tests hold the two to identical results). best_i holds the longest cached
 * prefix (overlaps[candidate.slot], 0 when absent), ties to the lower load, then the lower index;
 * min_i is the first candidate with the lowest load. A candidate's load is its attribute
 * `load_name`. Reading two attributes and a dict per candidate here costs a sixth of the
 * bytecode loop it replaces, on every Route over every worker; the attributes are read as
 * `__slots__` members where the candidates' class has them (member_offset: 35k -> 15k
 * instructions at 64 workers). The match walk's Overlaps is read by slot number, a dict by
 * lookup. NotImplemented (the caller runs the Python reference) when `overlaps` is neither, a
 * slot is not an int, or a depth or load is not an int of at most 64 bits.
 *
 * prefix_scan(candidates, overlaps, load_name, slots): the same, given the candidates'
 * CandidateSlots (as many as candidates, made from them since no candidate moved or left: the
 * caller's promise), which is read instead of the candidates when their load is a SlotLoad and
 * `overlaps` the walk's. */
static PyObject *
prefix_scan(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "prefix_scan(candidates, overlaps, load_name, slots=None) takes 3 or 4 arguments");
        return NULL;
    }
    PyObject *overlaps = args[1], *load_name = args[2];
    if (!PyUnicode_Check(load_name)) {
        PyErr_SetString(PyExc_TypeError, "load_name must be a str");
        return NULL;
    }
    OverlapsObject *by_slot;
    if (scan_overlaps(overlaps, &by_slot))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *seq = PySequence_Fast(args[0], "candidates must be a sequence");
    if (seq == NULL)
        return NULL;
    if (PySequence_Fast_GET_SIZE(seq) == 0) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "no candidates");
        return NULL;
    }
    ScanBest best = SCAN_START;
    ScanMembers members = {NULL, -1, -1, -1, 0};
    Py_ssize_t i = 0;
    PyObject *slots = nargs == 4 ? args[3] : Py_None;
    if (slots != Py_None && !Py_IS_TYPE(slots, &CandidateSlotsType)) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_TypeError, "slots must be a CandidateSlots or None");
        return NULL;
    }
    if (slots != Py_None && candidate_slots_apply((CandidateSlotsObject *)slots, seq, by_slot, load_name)) {
        scan_by_slots((CandidateSlotsObject *)slots, by_slot, ((CandidateSlotsObject *)slots)->column, &best);
        i = PySequence_Fast_GET_SIZE(seq);
    }
    /* the size and items are read again after each general read: a getter may resize a list */
    while (i < PySequence_Fast_GET_SIZE(seq)) {
        PyObject **items = PySequence_Fast_ITEMS(seq);
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (by_slot != NULL && Py_TYPE(items[i]) == members.type && members.slot_at >= 0 && members.loads_at >= 0) {
            i = scan_slot_loads(items, i, n, &members, by_slot, &best);
            if (i == n)
                break;
        }
        if (by_slot != NULL && Py_TYPE(items[i]) == members.type && members.slot_at >= 0 && members.load_at >= 0) {
            /* a run of one class's plain members over the walk's Overlaps (every Worker of a
             * Route): read in place, no reference taken, as nothing here runs Python code */
            PyTypeObject *type = members.type;
            Py_ssize_t slot_at = members.slot_at, load_at = members.load_at;
            for (; i < n; i++) {
                PyObject *item = items[i];
                if (Py_TYPE(item) != type)
                    break;
                PyObject *slot = *(PyObject **)((char *)item + slot_at);
                PyObject *load_obj = *(PyObject **)((char *)item + load_at);
                if (slot == NULL || load_obj == NULL || !PyLong_CheckExact(slot) || !PyLong_CheckExact(load_obj))
                    break;
                long long s, load;
                if (exact_long(load_obj, &load))
                    break;
                scan_take(&best, i, exact_long(slot, &s) ? 0 : overlaps_depth(by_slot, s), load);
            }
            if (i == n)
                break;
        }
        long long depth = 0, load = 0;
        int got = scan_item(items[i], overlaps, by_slot, load_name, &members, &depth, &load);
        if (got < 0)
            goto error;
        if (got > 0)
            goto python;
        scan_take(&best, i, depth, load);
        i++;
    }
    Py_ssize_t best_i = best.best_i, min_i = best.min_i;
    long long best_depth = best.best_depth, min_load = best.min_load, max_load = best.max_load;
    Py_DECREF(seq);
    return Py_BuildValue("(nLnLL)", best_i, best_depth, min_i, min_load, max_load);
python:
    Py_DECREF(seq);
    Py_RETURN_NOTIMPLEMENTED;
error:
    Py_DECREF(seq);
    return NULL;
}

static PyObject *
ties_by_slots(const CandidateSlotsObject *c, const OverlapsObject *by_slot, Py_ssize_t start, long long want_depth,
              long long want_load);

/* The arguments prefix_ties and fewest_counted_at_load share, checked: load_name (args[2]) a
 * str, start (args[3]) an index >= 0 into *start, and the optional slots (args[6]) a
 * CandidateSlots or None into *slots. 0, or -1 with the error set. */
static int
tie_args(PyObject *const *args, Py_ssize_t nargs, PyObject **slots, Py_ssize_t *start)
{
    *slots = nargs == 7 ? args[6] : Py_None;
    if (*slots != Py_None && !Py_IS_TYPE(*slots, &CandidateSlotsType)) {
        PyErr_SetString(PyExc_TypeError, "slots must be a CandidateSlots or None");
        return -1;
    }
    if (!PyUnicode_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "load_name must be a str");
        return -1;
    }
    *start = PyNumber_AsSsize_t(args[3], PyExc_OverflowError);
    if (*start == -1 && PyErr_Occurred())
        return -1;
    if (*start < 0) {
        PyErr_SetString(PyExc_ValueError, "start must be >= 0");
        return -1;
    }
    return 0;
}

/* prefix_ties(candidates, overlaps, load_name, start, depth, load) -> [i, ...]
 *
 * The indices from `start` on of the candidates whose cached prefix is `depth` (any, for a
 * negative `depth`) and load `load`, in order; the reference is policies/_scan.py:
 * tied_candidates_py. cache_aware asks it for the candidates tied with prefix_scan's best on both
 * (which can only follow it), and for those tied on the least load: one pass in C where a scan of
 * the rest per tie cost ~0.5 us each over 1,024 workers. NotImplemented as prefix_scan,
 * and when `depth` or `load` is not an int of at most 64 bits; ValueError for a negative start.
 *
 * prefix_ties(..., slots): the same, given the candidates' CandidateSlots (as prefix_scan takes
 * it): for a depth of 1 or more, the walk's entries of that depth are read instead of the
 * candidates (ties_by_slots). */
static PyObject *
prefix_ties(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "prefix_ties(candidates, overlaps, load_name, start, depth, load, slots=None) takes 6 or 7 arguments");
        return NULL;
    }
    PyObject *slots, *overlaps = args[1], *load_name = args[2];
    Py_ssize_t start;
    if (tie_args(args, nargs, &slots, &start) < 0)
        return NULL;
    OverlapsObject *by_slot;
    if (scan_overlaps(overlaps, &by_slot) || !PyLong_CheckExact(args[4]) || !PyLong_CheckExact(args[5]))
        Py_RETURN_NOTIMPLEMENTED;
    long long want_depth, want_load;
    if (exact_long(args[4], &want_depth) || exact_long(args[5], &want_load))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *seq = PySequence_Fast(args[0], "candidates must be a sequence");
    if (seq == NULL)
        return NULL;
    CandidateSlotsObject *c = (CandidateSlotsObject *)slots;
    if (slots != Py_None && want_depth > 0 && PySequence_Fast_GET_SIZE(seq) > 0 && c->index_of != NULL
        && candidate_slots_apply(c, seq, by_slot, load_name)) {
        Py_DECREF(seq);
        return ties_by_slots(c, by_slot, start, want_depth, want_load);
    }
    PyObject *ties = PyList_New(0);
    if (ties == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    ScanMembers members = {NULL, -1, -1, -1, 0};
    for (Py_ssize_t i = start; i < PySequence_Fast_GET_SIZE(seq); i++) {
        long long depth = 0, load = 0;
        int got = scan_item(PySequence_Fast_ITEMS(seq)[i], overlaps, by_slot, load_name, &members, &depth, &load);
        if (got < 0)
            goto error;
        if (got > 0) {
            Py_DECREF(seq);
            Py_DECREF(ties);
            Py_RETURN_NOTIMPLEMENTED;
        }
        if ((want_depth < 0 || depth == want_depth) && load == want_load) {
            PyObject *index = PyLong_FromSsize_t(i);
            int appended = index == NULL ? -1 : PyList_Append(ties, index);
            Py_XDECREF(index);
            if (appended < 0)
                goto error;
        }
    }
    Py_DECREF(seq);
    return ties;
error:
    Py_DECREF(seq);
    Py_DECREF(ties);
    return NULL;
}

/* fewest_counted_at_load(candidates, overlaps, load_name, start, load, counts, slots=None)
 *     -> i | NotImplemented
 *
 * Of the candidates from `start` on whose load (item.<load_name>) is `load`, the first whose id
 * has the fewest `counts` (a dict, id -> int; absent is 0): cache_aware's tie-break among the
 * least loaded (SGLang's fewest processed, then the lowest index). The reference is
 * policies/_scan.py: fewest_counted_at_load_py, the ties of prefix_ties (any depth) then the
 * fewest counted of them. An idle or evenly loaded fleet ties everywhere: over 1,024 workers the
 * list of ties and a second pass over it took ~80 us of a Route; here one pass reads each load
 * by slot (given the candidates' CandidateSlots, as prefix_scan takes it) and looks up the ties'
 * counts only. NotImplemented as prefix_ties, and for counts that are not a dict or a count that
 * is not an int of 64 bits, leaving them to the twin; ValueError for a negative start or no
 * candidate at that load.
 *
 * fewest_counted_at_load(..., slots, slot_counts, slot_owners): the counts also kept by slot, an
 * array('q') and a list as long, by a caller that keeps slot_counts[s] equal to counts[w.id]
 * wherever slot_owners[s] is w (cache_aware's on_dispatch). Given the candidates' slots, a tie
 * whose slot's owner is the candidate itself has its count read there, a pointer comparison and
 * an array read, where the id's dict lookup was ~20 ns a tie (~20 us over an idle fleet of
 * 1,024); any other tie is looked up by id as before. */
static PyObject *id_name; /* interned "id" */
static PyObject *fewest_counted_scan(PyObject *const *args, PyObject *slots, PyObject *overlaps,
                                     PyObject *load_name, Py_ssize_t start, PyObject *counts,
                                     const int64_t *slot_counts, PyObject *owners, Py_ssize_t cached);

static PyObject *
fewest_counted_at_load(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 && nargs != 7 && nargs != 9) {
        PyErr_SetString(PyExc_TypeError,
                        "fewest_counted_at_load(candidates, overlaps, load_name, start, load, counts, slots=None, "
                        "slot_counts=None, slot_owners=None) takes 6, 7 or 9 arguments");
        return NULL;
    }
    PyObject *slots, *overlaps = args[1], *load_name = args[2], *counts = args[5];
    Py_ssize_t start;
    if (tie_args(args, nargs < 7 ? nargs : 7, &slots, &start) < 0)
        return NULL;
    PyObject *owners = nargs == 9 ? args[8] : Py_None;
    if (nargs == 9 && ((args[7] == Py_None) != (owners == Py_None) || (owners != Py_None && !PyList_CheckExact(owners)))) {
        PyErr_SetString(PyExc_TypeError, "slot_counts and slot_owners must be an array('q') and a list, or both None");
        return NULL;
    }
    Py_buffer by_slot_view = {0};
    const int64_t *slot_counts = NULL;
    Py_ssize_t cached = 0;
    if (owners != Py_None) {
        if (PyObject_GetBuffer(args[7], &by_slot_view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            return NULL;
        if (by_slot_view.itemsize != 8 || by_slot_view.format == NULL || strcmp(by_slot_view.format, "q") != 0) {
            PyBuffer_Release(&by_slot_view);
            PyErr_SetString(PyExc_TypeError, "slot_counts must be an array('q')");
            return NULL;
        }
        slot_counts = (const int64_t *)by_slot_view.buf;
        cached = by_slot_view.len / 8;
        if (PyList_GET_SIZE(owners) < cached)
            cached = PyList_GET_SIZE(owners);
    }
    PyObject *result = fewest_counted_scan(args, slots, overlaps, load_name, start, counts, slot_counts, owners,
                                           cached);
    if (slot_counts != NULL)
        PyBuffer_Release(&by_slot_view);
    return result;
}

/* fewest_counted_at_load's pass, its arguments checked (`slot_counts` NULL: none kept by slot) */
static PyObject *
fewest_counted_scan(PyObject *const *args, PyObject *slots, PyObject *overlaps, PyObject *load_name, Py_ssize_t start,
                    PyObject *counts, const int64_t *slot_counts, PyObject *owners, Py_ssize_t cached)
{
    OverlapsObject *by_slot;
    long long want_load;
    if (scan_overlaps(overlaps, &by_slot) || !PyLong_CheckExact(args[4]) || exact_long(args[4], &want_load)
        || !PyDict_CheckExact(counts))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *seq = PySequence_Fast(args[0], "candidates must be a sequence");
    if (seq == NULL)
        return NULL;
    /* given the candidates' slots, their loads are one array: no Worker is read but the ties' */
    CandidateSlotsObject *c = (CandidateSlotsObject *)slots;
    const int64_t *loads = NULL;
    size_t capacity = 0;
    if (slots != Py_None && PySequence_Fast_GET_SIZE(seq) > 0 && candidate_slots_apply(c, seq, by_slot, load_name)) {
        loads = c->loads->values + c->column * c->loads->capacity;
        capacity = (size_t)c->loads->capacity;
    }
    ScanMembers members = {NULL, -1, -1, -1, 0};
    PyTypeObject *known = NULL;
    Py_ssize_t id_at = -1, best_i = -1;
    long long best = 0;
    for (Py_ssize_t i = start; i < PySequence_Fast_GET_SIZE(seq); i++) {
        long long load = 0;
        if (loads != NULL) {
            uint32_t slot = c->slots[i];
            load = slot < capacity ? loads[slot] : 0;
        } else {
            long long depth = 0;
            int got = scan_item(PySequence_Fast_ITEMS(seq)[i], overlaps, by_slot, load_name, &members, &depth, &load);
            if (got < 0)
                goto error;
            if (got > 0)
                goto not_mine;
        }
        if (load != want_load)
            continue;
        if (slot_counts != NULL && loads != NULL) {
            uint32_t slot = c->slots[i];
            /* the owner's count, kept equal to counts[id] by the caller; the list may not have
             * grown or shrunk since the call began: nothing here runs Python code but getters */
            if ((Py_ssize_t)slot < cached && (Py_ssize_t)slot < PyList_GET_SIZE(owners)
                && PyList_GET_ITEM(owners, slot) == PySequence_Fast_ITEMS(seq)[i]) {
                long long count = slot_counts[slot];
                if (best_i < 0 || count < best) {
                    best = count;
                    best_i = i;
                }
                continue;
            }
        }
        /* a Worker's id is a slot member: read at its offset, found once per type */
        PyObject *item = Py_NewRef(PySequence_Fast_ITEMS(seq)[i]); /* a getter run on it may drop the list's */
        if (Py_TYPE(item) != known) {
            known = Py_TYPE(item);
            id_at = member_offset(known, id_name);
        }
        PyObject *id = member_get(item, id_at, id_name);
        Py_DECREF(item);
        if (id == NULL)
            goto error;
        PyObject *value = PyDict_GetItemWithError(counts, id); /* borrowed, read before anything runs */
        Py_DECREF(id);
        long long count = 0;
        if (value == NULL) {
            if (PyErr_Occurred())
                goto error;
        } else if (!PyLong_CheckExact(value) || exact_long(value, &count)) {
            goto not_mine;
        }
        if (best_i < 0 || count < best) {
            best = count;
            best_i = i;
        }
    }
    Py_DECREF(seq);
    if (best_i < 0) {
        PyErr_SetString(PyExc_ValueError, "no ties");
        return NULL;
    }
    return PyLong_FromSsize_t(best_i);
not_mine:
    Py_DECREF(seq);
    Py_RETURN_NOTIMPLEMENTED;
error:
    Py_DECREF(seq);
    return NULL;
}

/* least_loaded_pick(candidates, slots) -> i | NotImplemented
 *
 * least_loaded's choice (policies/routing/least_loaded.py; its reference is
 * policies/_scan.py: least_loaded_index_py): the index of the candidate with the fewest
 * pending prefill tokens, then in-flight requests, then engine-reported queued requests, then
 * the lowest slot, the first of equals. Given the candidates' CandidateSlots the first two are
 * read by slot from the registry's loads, and a Worker's `reported_queue` only where those tie
 * with the best so far: an idle fleet ties everywhere, and a min() over 1,024 workers building
 * a key tuple for each was ~150 us. NotImplemented where that does not hold (no CandidateSlots
 * of these candidates, a candidate of another class, loads that are not SlotLoads, a queue that
 * is not an int of 64 bits), leaving them to the reference. */
static PyObject *pending_prefill_tokens_name; /* interned "pending_prefill_tokens" */
static PyObject *reported_queue_name;         /* interned "reported_queue" */
static PyObject *inflight_requests_name;      /* interned "inflight_requests" (set with the verdict's names) */

/* The pending prefill and in-flight columns of the registry's loads, by slot, for `n` candidates
 * whose CandidateSlots `c` is: 0, or 1 (NotImplemented: `c` is not of `n` candidates, or their
 * class keeps those loads elsewhere than in SlotLoads) */
typedef struct {
    const int64_t *pendings, *inflights;
    size_t capacity;
} CandidateLoads;

static int
candidate_loads(const CandidateSlotsObject *c, Py_ssize_t n, CandidateLoads *out)
{
    ScanMembers pending, inflight;
    if (n == 0 || Py_SIZE(c) != n)
        return 1;
    scan_members(&pending, c->cls, pending_prefill_tokens_name);
    scan_members(&inflight, c->cls, inflight_requests_name);
    if (pending.loads_at < 0 || inflight.loads_at < 0)
        return 1;
    const SlotLoadsObject *store = c->loads;
    out->pendings = store->values + pending.column * store->capacity;
    out->inflights = store->values + inflight.column * store->capacity;
    out->capacity = (size_t)store->capacity;
    return 0;
}

static PyObject *
least_loaded_pick(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "least_loaded_pick(candidates, slots) takes 2 arguments");
        return NULL;
    }
    if (!Py_IS_TYPE(args[1], &CandidateSlotsType))
        Py_RETURN_NOTIMPLEMENTED;
    const CandidateSlotsObject *c = (const CandidateSlotsObject *)args[1];
    PyObject *seq = PySequence_Fast(args[0], "candidates must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    CandidateLoads loads;
    if (candidate_loads(c, n, &loads)) {
        Py_DECREF(seq);
        Py_RETURN_NOTIMPLEMENTED;
    }
    Py_ssize_t queue_at = member_offset(c->cls, reported_queue_name);
    Py_ssize_t best_i = -1;
    long long best_pending = 0, best_inflight = 0, best_queue = 0;
    uint32_t best_slot = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PySequence_Fast_GET_SIZE(seq)) /* a getter run below shrank the list */
            goto not_mine;
        PyObject *item = PySequence_Fast_ITEMS(seq)[i];
        if (Py_TYPE(item) != c->cls)
            goto not_mine;
        uint32_t slot = c->slots[i];
        long long p = slot < loads.capacity ? loads.pendings[slot] : 0;
        long long f = slot < loads.capacity ? loads.inflights[slot] : 0;
        if (best_i >= 0 && (p > best_pending || (p == best_pending && f > best_inflight)))
            continue;
        Py_INCREF(item); /* a getter run on it may drop the list's reference */
        PyObject *queued = member_get(item, queue_at, reported_queue_name);
        Py_DECREF(item);
        if (queued == NULL) {
            Py_DECREF(seq);
            return NULL;
        }
        if (queue_at < 0 && candidate_loads(c, n, &loads)) { /* the getter may have grown (moved) the loads */
            Py_DECREF(queued);
            goto not_mine;
        }
        long long q = 0;
        int exact = PyLong_CheckExact(queued) && !exact_long(queued, &q);
        Py_DECREF(queued);
        if (!exact)
            goto not_mine;
        if (best_i < 0 || p < best_pending || f < best_inflight || q < best_queue
            || (q == best_queue && slot < best_slot)) {
            best_i = i;
            best_pending = p;
            best_inflight = f;
            best_queue = q;
            best_slot = slot;
        }
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(best_i);
not_mine:
    Py_DECREF(seq);
    Py_RETURN_NOTIMPLEMENTED;
}

/* prefix_ties over a CandidateSlots with a slot map, for a depth of 1 or more: the walk made its
 * entries in order of depth, so those of `want_depth` are one run of them, and each one's
 * candidate is index_of[slot]. Only the deepest are read where a pass over every candidate from
 * `start` took ~25 instructions each (1,024 workers, the ties following an early best). */
static PyObject *
ties_by_slots(const CandidateSlotsObject *c, const OverlapsObject *by_slot, Py_ssize_t start, long long want_depth,
              long long want_load)
{
    const SlotLoadsObject *store = c->loads;
    const int64_t *loads = store->values + c->column * store->capacity;
    size_t capacity = (size_t)store->capacity;
    const uint32_t *depths = by_slot->data, *order = by_slot->data + by_slot->width;
    Py_ssize_t k = by_slot->count;
    while (k > 0 && depths[order[k - 1]] > want_depth)
        k--;
    Py_ssize_t end = k; /* order[k .. end) are the entries of want_depth */
    while (k > 0 && depths[order[k - 1]] == want_depth)
        k--;
    int32_t *found = PyMem_New(int32_t, (size_t)(end - k + 1));
    if (found == NULL)
        return PyErr_NoMemory();
    Py_ssize_t n = 0;
    for (; k < end; k++) {
        uint32_t slot = order[k];
        int32_t i = slot < c->span ? c->index_of[slot] : -1;
        if (i >= start && (slot < capacity ? loads[slot] : 0) == want_load)
            found[n++] = i;
    }
    /* entries run by slot; candidates need not: the ties go back in candidate order */
    for (Py_ssize_t a = 1; a < n; a++) {
        int32_t v = found[a];
        Py_ssize_t b = a;
        for (; b > 0 && found[b - 1] > v; b--)
            found[b] = found[b - 1];
        found[b] = v;
    }
    PyObject *ties = PyList_New(n);
    for (Py_ssize_t a = 0; ties != NULL && a < n; a++) {
        PyObject *index = PyLong_FromLong(found[a]);
        if (index == NULL)
            Py_CLEAR(ties);
        else
            PyList_SET_ITEM(ties, a, index);
    }
    PyMem_Free(found);
    return ties;
}

/* ---- SlotsFiller: a frozen slotted dataclass built without its __init__ ------------------
 *
 * slots_filler(cls, names) -> filler; filler(*values) is cls(*values) for a class whose
 * __init__ only stores its arguments into the `__slots__` members `names` (a frozen
 * `@dataclass(slots=True)` with no __post_init__: what protocols.Stored is). The frozen
 * dataclass's __init__ stores each field through object.__setattr__, ~1,900 ns for Stored's ten
 * (~60 ns a block of a 32-block event, on every stored event PublishEvents converts); here the
 * instance is allocated and its members set directly, ~100 ns. Only a class whose every member is
 * named once, with no base class but object and no __dict__, is accepted, so no member is left
 * unset and nothing else of the class is skipped; tests/unit/index/test_native.py holds the
 * result equal to cls(*values). */
typedef struct {
    PyObject_HEAD
    PyTypeObject *cls;
    Py_ssize_t n;
    vectorcallfunc vectorcall;
    Py_ssize_t offsets[1]; /* n of them */
} SlotsFiller;

static PyTypeObject SlotsFillerType;

static PyObject *
slots_filler_call(SlotsFiller *f, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != f->n || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_Format(PyExc_TypeError, "%s filler takes exactly %zd positional arguments (%zd given)",
                     f->cls->tp_name, f->n, nargs);
        return NULL;
    }
    PyObject *obj = f->cls->tp_alloc(f->cls, 0);
    if (obj == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++)
        *(PyObject **)((char *)obj + f->offsets[i]) = Py_NewRef(args[i]);
    return obj;
}

static void
SlotsFiller_dealloc(SlotsFiller *f)
{
    Py_DECREF(f->cls);
    PyObject_Free(f);
}

static PyTypeObject SlotsFillerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvrouterd.index._native.SlotsFiller",
    .tp_basicsize = offsetof(SlotsFiller, offsets),
    .tp_itemsize = sizeof(Py_ssize_t),
    .tp_dealloc = (destructor)SlotsFiller_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(SlotsFiller, vectorcall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "cls(*values) for a slotted class whose __init__ only stores them (see slots_filler)",
};

static PyObject *
slots_filler(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyType_Check(args[0]) || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "slots_filler(cls, names: tuple[str, ...]) takes a class and a tuple");
        return NULL;
    }
    PyTypeObject *cls = (PyTypeObject *)args[0];
    PyObject *names = args[1];
    Py_ssize_t n = PyTuple_GET_SIZE(names), members = 0;
    if (cls->tp_base != &PyBaseObject_Type || cls->tp_dictoffset != 0 || cls->tp_members == NULL) {
        PyErr_Format(PyExc_TypeError, "%s is not a __slots__ class deriving from object alone", cls->tp_name);
        return NULL;
    }
    for (PyMemberDef *m = cls->tp_members; m->name != NULL; m++)
        members++;
    if (members != n) {
        PyErr_Format(PyExc_TypeError, "%s has %zd members, %zd names given", cls->tp_name, members, n);
        return NULL;
    }
    SlotsFiller *f = PyObject_NewVar(SlotsFiller, &SlotsFillerType, n > 0 ? n : 1);
    if (f == NULL)
        return NULL;
    f->cls = (PyTypeObject *)Py_NewRef(cls);
    f->n = n;
    f->vectorcall = (vectorcallfunc)slots_filler_call;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        Py_ssize_t offset = PyUnicode_Check(name) ? member_offset(cls, name) : -1;
        for (Py_ssize_t j = 0; offset >= 0 && j < i; j++)
            if (f->offsets[j] == offset)
                offset = -1; /* named twice */
        if (offset < 0) {
            PyErr_Format(PyExc_TypeError, "%R is not a distinct __slots__ member of %s", name, cls->tp_name);
            Py_DECREF(f);
            return NULL;
        }
        f->offsets[i] = offset;
    }
    return (PyObject *)f;
}

/* ---- PublishEvents' EventBatch read from its wire bytes (issue #12) ---------------------------
 *
 * read_event_batch(data, max_events, max_id_length, new_batch, new_stored, new_removed, new_cleared,
 *                  max_blocks, block_size, event_blocks) -> new_batch(worker_id, sequence, events) | None
 *
 * What server/convert.py: event_batch(EventBatch.FromString(data), limits) makes
 * of a batch, read straight from the bytes: the reference parses every event into upb messages,
 * then reads each field back through a Python attribute and makes an int per engine hash twice
 * (a list, then a tuple): ~290 ns a stored block of the bench's 32-block events, a third of the
 * daemon's work per block; here ~80 (callgrind: 3,061 -> 2,483 instructions a block for the
 * daemon's whole work per stored block). The events are built by the callables passed in (convert.py
 * passes the core dataclasses' positional constructors): new_stored(token_ids, engine_hashes,
 * parent_engine_hash, block_size, model, lora, None, None, cache_salt, None),
 * new_removed(engine_hashes, None), new_cleared(), new_batch(worker_id, sequence, events).
 *
 * Only the plain form that protobuf encoders write is read here, and None leaves everything else
 * to the reference, so where this answers it answers as the reference does, and every error
 * (upb's DecodeError, convert's InvalidRequest or Overloaded) comes from the reference: a field
 * that is not one of the schema's with its wire type (unknown fields, an AllBlocksCleared with
 * any, unpacked repeated scalars, groups); a field given twice where protobuf would merge or keep
 * the last (a singular field, a packed field in two runs, a CacheEvent with two of its oneof); a
 * malformed or cut varint or length, a tag or length of more than five bytes (which upb refuses
 * even when its value fits); a string that is not strict UTF-8; what convert refuses (an
 * empty or too long worker_id, a sequence above 2**63-1, more than max_events events, a
 * CacheEvent with no event, a stored event with both token fields, a token_ids_le32 whose length
 * is not a multiple of 4); a stored event with neither token field (convert's empty tokens, which
 * the Router refuses); a block_size or token id varint above 2**32-1 (upb keeps its low 32
 * bits); and a batch of more than max_blocks blocks (convert's batch_blocks: each event counts
 * its pages, tokens // (its block_size or the router's block_size), or its engine hashes if more,
 * and at least event_blocks), found by counting each event before any of its ints is made, so an oversized
 * batch costs at most max_blocks blocks' work here before the reference refuses it. Token ids come as the bytes of token_ids_le32, or from packed token_ids as little-endian
 * uint32s (convert's _le_u32). */
typedef struct {
    const unsigned char *p, *end;
} WireReader;

/* One varint: 0, or -1 when it is longer than 10 bytes, overflows 64 bits or is cut short. */
static inline int
wire_varint(WireReader *w, uint64_t *out)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (w->p >= w->end)
            return -1;
        unsigned char b = *w->p++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (b < 0x80) {
            if (shift == 63 && b > 1)
                return -1;
            *out = v;
            return 0;
        }
    }
    return -1;
}

/* A length-delimited payload into `out`; -1 when its length is malformed, of more than five
 * bytes (upb refuses a longer one, as a tag: WIRE_MOST_SIZE_BYTES) or past the end. */
enum { WIRE_MOST_SIZE_BYTES = 5 };
static inline int
wire_bytes(WireReader *w, WireReader *out)
{
    uint64_t n;
    const unsigned char *start = w->p;
    if (wire_varint(w, &n) < 0 || w->p - start > WIRE_MOST_SIZE_BYTES || n > (uint64_t)(w->end - w->p))
        return -1;
    out->p = w->p;
    out->end = w->p + n;
    w->p += n;
    return 0;
}

/* A field's tag: its number and wire type; -1 when malformed, of more than five bytes (upb
 * refuses a longer one even when its value fits) or number 0. */
static inline int
wire_tag(WireReader *w, uint32_t *field, unsigned *type)
{
    uint64_t tag;
    const unsigned char *start = w->p;
    if (wire_varint(w, &tag) < 0 || w->p - start > WIRE_MOST_SIZE_BYTES || tag > 0xffffffffu || (tag >> 3) == 0)
        return -1;
    *field = (uint32_t)(tag >> 3);
    *type = (unsigned)(tag & 7);
    return 0;
}

enum { WIRE_VARINT = 0, WIRE_FIXED64 = 1, WIRE_LEN = 2 };

/* a fixed64 field's payload as a double: 0, or -1 when cut short */
static inline int
wire_double(WireReader *w, double *out)
{
    if (w->end - w->p < 8)
        return -1;
    uint64_t bits = 0;
    for (int i = 7; i >= 0; i--)
        bits = bits << 8 | w->p[i];
    memcpy(out, &bits, sizeof bits);
    w->p += 8;
    return 0;
}

/* The packed uint64s of `w`, n of them (its count_varints, which the caller counted against the
 * batch's budget, >= 0), as a tuple of ints (NULL with an error set), or Py_None with *plain
 * cleared when a varint is malformed. An empty payload is an empty tuple. */
static PyObject *
wire_u64_tuple(WireReader w, Py_ssize_t n, int *plain)
{
    PyObject *out = PyTuple_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v;
        if (wire_varint(&w, &v) < 0) {
            Py_DECREF(out);
            *plain = 0;
            Py_RETURN_NONE;
        }
        PyObject *item = PyLong_FromUnsignedLongLong(v);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, item);
    }
    return out;
}

/* A string field's payload as str (NULL with an error set), or NULL with *plain cleared and
 * no error when it is not strict UTF-8 (upb refuses such a string field). */
static PyObject *
wire_str(WireReader w, int *plain)
{
    PyObject *s = PyUnicode_DecodeUTF8((const char *)w.p, w.end - w.p, NULL);
    if (s == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        *plain = 0;
    }
    return s;
}

/* Packed uint32 token ids as little-endian uint32 bytes, or NULL with *plain cleared and no
 * error when a varint is malformed or above 2**32-1, or there are none. */
static PyObject *
wire_u32_le(WireReader w, int *plain)
{
    Py_ssize_t n = count_varints(w.p, w.end - w.p);
    if (n <= 0 || n > PY_SSIZE_T_MAX / 4) {
        *plain = 0;
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL)
        return NULL;
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v;
        if (wire_varint(&w, &v) < 0 || v > 0xffffffffu) {
            Py_DECREF(out);
            *plain = 0;
            return NULL;
        }
        o[4 * i] = (unsigned char)v;
        o[4 * i + 1] = (unsigned char)(v >> 8);
        o[4 * i + 2] = (unsigned char)(v >> 16);
        o[4 * i + 3] = (unsigned char)(v >> 24);
    }
    return out;
}

typedef struct {
    PyObject *new_stored, *new_removed, *new_cleared;
    /* blocks the batch may still carry (max_blocks less those read so far), and the router's
     * block size, which a stored event without its own block_size counts in, and the least an
     * event counts (its own cost, whatever it carries) */
    Py_ssize_t blocks_left, block_size, event_blocks;
} EventMakers;

/* Count an event's blocks (at least event_blocks) against the batch's budget: 0, or -1 when they do not fit. */
static inline int
take_blocks(EventMakers *make, Py_ssize_t blocks)
{
    make->blocks_left -= blocks > make->event_blocks ? blocks : make->event_blocks;
    return make->blocks_left < 0 ? -1 : 0;
}

/* A StoredBlocks payload as new_stored(...); NULL with an error set, or NULL and *plain cleared. */
static PyObject *
wire_stored(WireReader w, EventMakers *make, int *plain)
{
    enum { PARENT = 1, HASHES = 2, TOKENS = 3, BLOCK_SIZE = 4, MODEL = 5, LORA = 6, SALT = 7, LE32 = 8 };
    WireReader payload[9] = {{NULL, NULL}};
    PyObject *values[10] = {NULL};
    unsigned seen = 0;
    uint64_t parent = 0, block_size = 0;
    while (w.p < w.end) {
        uint32_t field;
        unsigned type;
        if (wire_tag(&w, &field, &type) < 0 || field > LE32 || (seen & (1u << field)))
            goto other;
        seen |= 1u << field;
        if (field == PARENT || field == BLOCK_SIZE) {
            if (type != WIRE_VARINT || wire_varint(&w, field == PARENT ? &parent : &block_size) < 0)
                goto other;
        }
        else if (type != WIRE_LEN || wire_bytes(&w, &payload[field]) < 0)
            goto other;
    }
    if (block_size > 0xffffffffu)
        goto other;
    Py_ssize_t packed = payload[LE32].end - payload[LE32].p, repeated = payload[TOKENS].end - payload[TOKENS].p;
    if ((packed == 0) == (repeated == 0) || packed % 4)
        goto other; /* both token fields or neither, or a malformed packed one: convert's error */
    Py_ssize_t tokens = packed ? packed / 4 : count_varints(payload[TOKENS].p, repeated);
    Py_ssize_t hashes = count_varints(payload[HASHES].p, payload[HASHES].end - payload[HASHES].p);
    Py_ssize_t pages = tokens < 0 ? 0 : tokens / (block_size ? (Py_ssize_t)block_size : make->block_size);
    if (tokens < 0 || hashes < 0 || take_blocks(make, pages > hashes ? pages : hashes) < 0)
        goto other; /* a malformed varint (upb's error), or over the budget (convert's) */
    if (packed)
        values[0] = PyBytes_FromStringAndSize((const char *)payload[LE32].p, packed);
    else
        values[0] = wire_u32_le(payload[TOKENS], plain);
    if (values[0] == NULL)
        goto done;
    if (payload[HASHES].p != payload[HASHES].end) {
        values[1] = wire_u64_tuple(payload[HASHES], hashes, plain);
        if (values[1] == NULL || !*plain)
            goto done;
    }
    else
        values[1] = Py_NewRef(Py_None); /* no engine hashes: convert's None, not () */
    values[2] = (seen & (1u << PARENT)) ? PyLong_FromUnsignedLongLong(parent) : Py_NewRef(Py_None);
    values[3] = PyLong_FromUnsignedLongLong(block_size);
    if (values[2] == NULL || values[3] == NULL)
        goto done;
    if ((values[4] = wire_str(payload[MODEL], plain)) == NULL || (values[5] = wire_str(payload[LORA], plain)) == NULL
        || (values[8] = wire_str(payload[SALT], plain)) == NULL)
        goto done;
    values[6] = Py_NewRef(Py_None); /* group */
    values[7] = Py_NewRef(Py_None); /* group_kind */
    values[9] = Py_NewRef(Py_None); /* extra_hashes */
    PyObject *stored = PyObject_Vectorcall(make->new_stored, values, 10, NULL);
    for (int i = 0; i < 10; i++)
        Py_DECREF(values[i]);
    return stored;
done:
    for (int i = 0; i < 10; i++)
        Py_XDECREF(values[i]);
    return NULL;
other:
    *plain = 0;
    return NULL;
}

/* A CacheEvent payload as a core event; NULL with an error set, or NULL and *plain cleared. */
static PyObject *
wire_event(WireReader w, EventMakers *make, int *plain)
{
    uint32_t kind = 0;
    WireReader payload = {NULL, NULL};
    while (w.p < w.end) {
        uint32_t field;
        unsigned type;
        /* a second member of the oneof (or the same one again: merged) is the reference's */
        if (wire_tag(&w, &field, &type) < 0 || field > 3 || type != WIRE_LEN || kind != 0
            || wire_bytes(&w, &payload) < 0) {
            *plain = 0;
            return NULL;
        }
        kind = field;
    }
    if (kind == 1)
        return wire_stored(payload, make, plain);
    if (kind == 2) {
        PyObject *hashes = NULL;
        WireReader hashes_payload = {NULL, NULL};
        while (payload.p < payload.end) {
            uint32_t field;
            unsigned type;
            if (wire_tag(&payload, &field, &type) < 0 || field != 1 || type != WIRE_LEN || hashes_payload.p != NULL
                || wire_bytes(&payload, &hashes_payload) < 0) {
                *plain = 0;
                return NULL;
            }
        }
        Py_ssize_t n = count_varints(hashes_payload.p, hashes_payload.end - hashes_payload.p);
        if (n < 0 || take_blocks(make, n) < 0) {
            *plain = 0;
            return NULL;
        }
        hashes = wire_u64_tuple(hashes_payload, n, plain);
        if (hashes == NULL || !*plain) {
            Py_XDECREF(hashes);
            return NULL;
        }
        PyObject *values[2] = {hashes, Py_None};
        PyObject *removed = PyObject_Vectorcall(make->new_removed, values, 2, NULL);
        Py_DECREF(hashes);
        return removed;
    }
    if (kind == 3 && payload.p == payload.end && take_blocks(make, 1) == 0)
        return PyObject_Vectorcall(make->new_cleared, NULL, 0, NULL);
    *plain = 0; /* no event set, or an AllBlocksCleared with fields */
    return NULL;
}

static PyObject *
read_event_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "read_event_batch(data, max_events, max_id_length, new_batch, new_stored, "
                                         "new_removed, new_cleared, max_blocks, block_size, event_blocks) takes 10 "
                                         "arguments");
        return NULL;
    }
    Py_ssize_t max_events = PyLong_AsSsize_t(args[1]), max_id_length = PyLong_AsSsize_t(args[2]);
    Py_ssize_t max_blocks = PyLong_AsSsize_t(args[7]), block_size = PyLong_AsSsize_t(args[8]);
    Py_ssize_t event_blocks = PyLong_AsSsize_t(args[9]);
    if ((max_events == -1 || max_id_length == -1 || max_blocks == -1 || block_size == -1 || event_blocks == -1)
        && PyErr_Occurred())
        return NULL;
    if (block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "read_event_batch: block_size must be > 0");
        return NULL;
    }
    EventMakers make = {args[4], args[5], args[6], max_blocks, block_size, event_blocks};
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    WireReader w = {(const unsigned char *)view.buf, (const unsigned char *)view.buf + view.len};
    WireReader worker = {NULL, NULL};
    uint64_t sequence = 0;
    unsigned seen = 0;
    int plain = 1;
    PyObject *events = PyList_New(0), *worker_id = NULL, *result = NULL;
    if (events == NULL)
        goto done;
    while (w.p < w.end) {
        uint32_t field;
        unsigned type;
        if (wire_tag(&w, &field, &type) < 0 || field > 4)
            goto other;
        if (field == 3) { /* events: repeated */
            WireReader payload;
            if (type != WIRE_LEN || wire_bytes(&w, &payload) < 0 || PyList_GET_SIZE(events) >= max_events)
                goto other;
            PyObject *event = wire_event(payload, &make, &plain);
            if (event == NULL)
                goto done;
            int failed = PyList_Append(events, event);
            Py_DECREF(event);
            if (failed < 0)
                goto done;
            continue;
        }
        if (seen & (1u << field))
            goto other;
        seen |= 1u << field;
        if (field == 1) {
            if (type != WIRE_LEN || wire_bytes(&w, &worker) < 0)
                goto other;
        }
        else if (field == 2) {
            if (type != WIRE_VARINT || wire_varint(&w, &sequence) < 0)
                goto other;
        }
        else { /* 4: timestamp, a double, informational */
            double timestamp;
            if (type != WIRE_FIXED64 || wire_double(&w, &timestamp) < 0)
                goto other;
        }
    }
    if (worker.p == worker.end || sequence > (uint64_t)INT64_MAX)
        goto other; /* no worker_id, or a sequence past 2**63-1: convert's errors */
    worker_id = wire_str(worker, &plain);
    if (worker_id == NULL || PyUnicode_GET_LENGTH(worker_id) > max_id_length)
        goto other;
    PyObject *tuple = PyList_AsTuple(events), *seq = PyLong_FromUnsignedLongLong(sequence);
    if (tuple != NULL && seq != NULL) {
        PyObject *values[3] = {worker_id, seq, tuple};
        result = PyObject_Vectorcall(args[3], values, 3, NULL);
    }
    Py_XDECREF(tuple);
    Py_XDECREF(seq);
    goto done;
other:
    plain = 0;
done:
    PyBuffer_Release(&view);
    Py_XDECREF(events);
    Py_XDECREF(worker_id);
    if (result == NULL && !plain && !PyErr_Occurred())
        Py_RETURN_NONE;
    return result;
}

/* ---- an OpenAI request body's prompt, read with the GIL released (ext_proc, issue #16 item 1) --
 *
 * openai_prompt(body, chat) -> None | (model_start, model_end, is_text, payload, length)
 *
 * What server/openai_prompt.parse_body reads from a body with json.loads, read here from the
 * bytes without building a Python object per token or character, so a multi-MiB body can be
 * read on a worker thread while the event loop keeps routing. The whole body is validated first
 * as strict JSON; then, for /completions (`chat` false), `prompt` as a list of token ids (payload:
 * little-endian uint32s, length: their count) or a string (payload: its UTF-8 bytes); for
 * /chat/completions, `messages` rendered as render_messages does, `<|role|>\n{content}\n` per
 * message (payload: the UTF-8 bytes). A text payload is zero-padded to a multiple of 4 (what
 * approximate text keys hash) and `length` is the text's own length. model_start/end are the
 * offsets of the top-level `model` string token, quotes included (-1, -1 when absent): Python
 * decodes that one small string.
 *
 * Returns None whenever json.loads + parse_body might read the body differently, leaving the
 * answer (or the error) to them: invalid JSON; anything json.loads accepts beyond strict JSON
 * (NaN, Infinity, UTF-8-encoded surrogates, which its 'surrogatepass' decoding lets through, a
 * byte-order mark); nesting deeper than OJ_MAX_DEPTH; integers of more than OJ_MAX_DIGITS digits
 * (Python's int() may refuse them); an escape in a key it must compare; a `\u` escape that
 * leaves a lone surrogate; and every prompt it does not read itself (a batched or invalid
 * prompt, a non-text content part, tool_calls, a non-string model...). So where it answers, it
 * answers exactly as the Python parser would (tests/unit/server/test_openai_prompt.py holds the
 * two equal), and a body it declines costs what it cost before. */
#define OJ_MAX_DEPTH 128
#define OJ_MAX_DIGITS 20

static Py_ssize_t
oj_ws(const unsigned char *s, Py_ssize_t n, Py_ssize_t i)
{
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r'))
        i++;
    return i;
}

static int
oj_hex(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Bytes are read 8 at a time where a string is plain: prompts are long runs of ASCII text
 * between escapes. Each test below is exact about "none of these 8 bytes is special"; when
 * one may be, the bytes are looked at one by one. */
static const uint64_t oj_ones = 0x0101010101010101ull, oj_highs = 0x8080808080808080ull;

static inline uint64_t
oj_has_byte(uint64_t w, unsigned char c)
{
    uint64_t x = w ^ (oj_ones * c);
    return (x - oj_ones) & ~x & oj_highs;
}

/* The first index >= i (< n) holding '"', '\\', a control character or a non-ASCII byte. */
static Py_ssize_t
oj_plain(const unsigned char *s, Py_ssize_t n, Py_ssize_t i)
{
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        if ((oj_has_byte(w, '"') | oj_has_byte(w, '\\') | ((w - oj_ones * 0x20) & oj_highs) | (w & oj_highs)) != 0)
            break;
    }
    while (i < n && s[i] >= 0x20 && s[i] < 0x80 && s[i] != '"' && s[i] != '\\')
        i++;
    return i;
}

/* The first index >= i (< n) holding '"' or '\\' (in validated JSON, one always follows). */
static Py_ssize_t
oj_quote_or_escape(const unsigned char *s, Py_ssize_t n, Py_ssize_t i)
{
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        if ((oj_has_byte(w, '"') | oj_has_byte(w, '\\')) != 0)
            break;
    }
    while (s[i] != '"' && s[i] != '\\')
        i++;
    return i;
}

/* The string token at s[i] == '"': the index after its closing quote, or -1. Strict UTF-8 (no
 * overlongs, no surrogates, nothing past U+10FFFF), no raw control characters, valid escapes.
 * *escaped is set when the token holds a backslash. */
static Py_ssize_t
oj_string(const unsigned char *s, Py_ssize_t n, Py_ssize_t i, int *escaped)
{
    i++;
    while ((i = oj_plain(s, n, i)) < n) {
        unsigned char c = s[i];
        if (c == '"')
            return i + 1;
        if (c == '\\') {
            *escaped = 1;
            if (i + 1 >= n)
                return -1;
            unsigned char e = s[i + 1];
            if (e == 'u') {
                if (i + 6 > n)
                    return -1;
                for (int k = 2; k < 6; k++)
                    if (oj_hex(s[i + k]) < 0)
                        return -1;
                i += 6;
            }
            else if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' || e == 't') {
                i += 2;
            }
            else {
                return -1;
            }
            continue;
        }
        if (c < 0x20)
            return -1;
        if (c < 0x80) {
            i++;
            continue;
        }
        Py_ssize_t len;
        if (c >= 0xC2 && c <= 0xDF)
            len = 2;
        else if (c >= 0xE0 && c <= 0xEF)
            len = 3;
        else if (c >= 0xF0 && c <= 0xF4)
            len = 4;
        else
            return -1;
        if (i + len > n)
            return -1;
        for (Py_ssize_t k = 1; k < len; k++)
            if ((s[i + k] & 0xC0) != 0x80)
                return -1;
        unsigned char c1 = s[i + 1];
        if ((c == 0xE0 && c1 < 0xA0) || (c == 0xED && c1 >= 0xA0) || (c == 0xF0 && c1 < 0x90) || (c == 0xF4 && c1 >= 0x90))
            return -1;
        i += len;
    }
    return -1;
}

static int
oj_digit(const unsigned char *s, Py_ssize_t n, Py_ssize_t i)
{
    return i < n && s[i] >= '0' && s[i] <= '9';
}

/* The number token at s[i]: the index after it, or -1. *integer is set when it has neither a
 * fraction nor an exponent (json.loads makes it an int). */
static Py_ssize_t
oj_number(const unsigned char *s, Py_ssize_t n, Py_ssize_t i, int *integer)
{
    Py_ssize_t j = i;
    if (j < n && s[j] == '-')
        j++;
    Py_ssize_t digits = j;
    if (j < n && s[j] == '0')
        j++;
    else if (oj_digit(s, n, j))
        while (oj_digit(s, n, j))
            j++;
    else
        return -1;
    digits = j - digits;
    *integer = 1;
    if (j < n && s[j] == '.') {
        if (!oj_digit(s, n, ++j))
            return -1;
        while (oj_digit(s, n, j))
            j++;
        *integer = 0;
    }
    if (j < n && (s[j] == 'e' || s[j] == 'E')) {
        j++;
        if (j < n && (s[j] == '+' || s[j] == '-'))
            j++;
        if (!oj_digit(s, n, j))
            return -1;
        while (oj_digit(s, n, j))
            j++;
        *integer = 0;
    }
    if (*integer && digits > OJ_MAX_DIGITS)
        return -1;
    return j;
}

static Py_ssize_t
oj_literal(const unsigned char *s, Py_ssize_t n, Py_ssize_t i, const char *word, Py_ssize_t len)
{
    return i + len <= n && memcmp(s + i, word, (size_t)len) == 0 ? i + len : -1;
}

/* The value at s[i] (whitespace skipped): the index after it, or -1. */
static Py_ssize_t
oj_value(const unsigned char *s, Py_ssize_t n, Py_ssize_t i, int depth)
{
    int flag = 0;
    if (i >= n)
        return -1;
    switch (s[i]) {
    case '"':
        return oj_string(s, n, i, &flag);
    case 't':
        return oj_literal(s, n, i, "true", 4);
    case 'f':
        return oj_literal(s, n, i, "false", 5);
    case 'n':
        return oj_literal(s, n, i, "null", 4);
    case '{':
    case '[': {
        unsigned char close = s[i] == '{' ? '}' : ']';
        if (depth >= OJ_MAX_DEPTH)
            return -1;
        i = oj_ws(s, n, i + 1);
        if (i < n && s[i] == close)
            return i + 1;
        for (;;) {
            if (close == '}') {
                if (i >= n || s[i] != '"' || (i = oj_string(s, n, i, &flag)) < 0)
                    return -1;
                i = oj_ws(s, n, i);
                if (i >= n || s[i] != ':')
                    return -1;
                i = oj_ws(s, n, i + 1);
            }
            if ((i = oj_value(s, n, i, depth + 1)) < 0)
                return -1;
            i = oj_ws(s, n, i);
            if (i < n && s[i] == ',')
                i = oj_ws(s, n, i + 1);
            else if (i < n && s[i] == close)
                return i + 1;
            else
                return -1;
        }
    }
    default:
        return oj_number(s, n, i, &flag);
    }
}

/* The end of the value at s[i] in JSON oj_value has validated: a cheaper walk than validating
 * again (strings are scanned for their closing quote only). */
static Py_ssize_t
oj_skip(const unsigned char *s, Py_ssize_t n, Py_ssize_t i)
{
    unsigned char c = s[i];
    if (c == '"') {
        for (i = oj_quote_or_escape(s, n, i + 1); s[i] != '"'; i = oj_quote_or_escape(s, n, i + 2))
            ;
        return i + 1;
    }
    if (c == '{' || c == '[') {
        int depth = 0;
        for (;;) {
            c = s[i];
            if (c == '"') {
                i = oj_skip(s, n, i);
                continue;
            }
            if (c == '{' || c == '[')
                depth++;
            else if ((c == '}' || c == ']') && --depth == 0)
                return i + 1;
            i++;
        }
    }
    /* a number or a literal: up to the next delimiter */
    while (s[i] != ',' && s[i] != '}' && s[i] != ']' && s[i] != ' ' && s[i] != '\t' && s[i] != '\n' && s[i] != '\r')
        i++;
    return i;
}

/* A span of validated JSON: [start, end) of one value, or start = -1 when absent. */
typedef struct {
    Py_ssize_t start, end;
} OJSpan;

/* Whether the key token s[k:...] (at its opening quote) spells `word` with no escape. */
static int
oj_key_is(const unsigned char *s, Py_ssize_t k, Py_ssize_t k_end, const char *word)
{
    size_t len = strlen(word);
    return (size_t)(k_end - k) == len + 2 && memcmp(s + k + 1, word, len) == 0;
}

/* The members of the validated object at s[i] == '{' named in `names` (the last of each, as a
 * dict keeps it): their value spans in `out`. -1 when a key holds an escape (it might spell one
 * of the names), else the index after the object. */
static Py_ssize_t
oj_members(const unsigned char *s, Py_ssize_t n, Py_ssize_t i, const char *const *names, OJSpan *out, int count)
{
    for (int m = 0; m < count; m++)
        out[m].start = out[m].end = -1;
    i = oj_ws(s, n, i + 1);
    if (s[i] == '}')
        return i + 1;
    for (;;) {
        int escaped = 0;
        Py_ssize_t key = i;
        i = oj_string(s, n, i, &escaped);
        if (escaped)
            return -1;
        Py_ssize_t key_end = i;
        Py_ssize_t value = oj_ws(s, n, oj_ws(s, n, i) + 1); /* past the ':' */
        i = oj_skip(s, n, value);
        for (int m = 0; m < count; m++) {
            if (oj_key_is(s, key, key_end, names[m])) {
                out[m].start = value;
                out[m].end = i;
            }
        }
        i = oj_ws(s, n, i);
        if (s[i] == '}')
            return i + 1;
        i = oj_ws(s, n, i + 1); /* past the ',' */
    }
}

static Py_ssize_t
oj_put_utf8(unsigned char *out, Py_ssize_t k, uint32_t cp)
{
    if (cp < 0x80) {
        out[k++] = (unsigned char)cp;
    }
    else if (cp < 0x800) {
        out[k++] = (unsigned char)(0xC0 | (cp >> 6));
        out[k++] = (unsigned char)(0x80 | (cp & 0x3F));
    }
    else if (cp < 0x10000) {
        out[k++] = (unsigned char)(0xE0 | (cp >> 12));
        out[k++] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        out[k++] = (unsigned char)(0x80 | (cp & 0x3F));
    }
    else {
        out[k++] = (unsigned char)(0xF0 | (cp >> 18));
        out[k++] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
        out[k++] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        out[k++] = (unsigned char)(0x80 | (cp & 0x3F));
    }
    return k;
}

static uint32_t
oj_hex4(const unsigned char *p)
{
    return (uint32_t)(oj_hex(p[0]) << 12 | oj_hex(p[1]) << 8 | oj_hex(p[2]) << 4 | oj_hex(p[3]));
}

/* Appends the text of the validated string token at s[i] to out[*k...] (never more bytes than
 * the token takes). The index after the token, or -1 for a lone surrogate: json.loads would
 * keep it in the str, which cannot be encoded as UTF-8. */
/* The code point of the escape at s[*i] (a backslash in a validated string token), *i moved
 * past it (and past the low half of a surrogate pair); -1 for a lone surrogate, which
 * json.loads would let through as itself but UTF-8 cannot carry. */
static int64_t
oj_escaped(const unsigned char *s, Py_ssize_t *i)
{
    unsigned char e = s[*i + 1];
    if (e != 'u') {
        *i += 2;
        return e == 'b' ? '\b' : e == 'f' ? '\f' : e == 'n' ? '\n' : e == 'r' ? '\r' : e == 't' ? '\t' : e;
    }
    uint32_t cp = oj_hex4(s + *i + 2);
    *i += 6;
    if (cp >= 0xDC00 && cp <= 0xDFFF)
        return -1;
    if (cp >= 0xD800 && cp <= 0xDBFF) {
        if (s[*i] != '\\' || s[*i + 1] != 'u')
            return -1;
        uint32_t low = oj_hex4(s + *i + 2);
        if (low < 0xDC00 || low > 0xDFFF)
            return -1;
        cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
        *i += 6;
    }
    return cp;
}

static Py_ssize_t
oj_unescape(const unsigned char *s, Py_ssize_t n, Py_ssize_t i, unsigned char *out, Py_ssize_t *k)
{
    i++;
    for (;;) {
        Py_ssize_t run = i;
        i = oj_quote_or_escape(s, n, i);
        memcpy(out + *k, s + run, (size_t)(i - run));
        *k += i - run;
        if (s[i] == '"')
            return i + 1;
        int64_t cp = oj_escaped(s, &i);
        if (cp < 0)
            return -1;
        *k = oj_put_utf8(out, *k, (uint32_t)cp);
    }
}

/* Whether the validated value at s[i:end] is the string "text", spelled without escapes. */
static int
oj_is_text(const unsigned char *s, OJSpan v)
{
    return v.end - v.start == 6 && memcmp(s + v.start, "\"text\"", 6) == 0;
}

/* ---- canonical JSON: what _canonical renders (json.dumps, sort_keys=True, separators=(",", ":"),
 * ensure_ascii=False), for the content parts and tool calls render_messages appends as JSON */
#define OJ_MAX_SORTED_MEMBERS 64

static const char oj_hexdigits[] = "0123456789abcdef";

/* The string token at s[i] as json.dumps writes the str it decodes to: `"`, `\`, and the
 * control characters escaped (\b \f \n \r \t, else \u00xx), everything else as UTF-8. The index
 * after the token, or -1 for a lone surrogate. */
static Py_ssize_t
oj_canonical_string(const unsigned char *s, Py_ssize_t n, Py_ssize_t i, unsigned char *out, Py_ssize_t *k)
{
    out[(*k)++] = '"';
    i++;
    for (;;) {
        Py_ssize_t run = i;
        i = oj_quote_or_escape(s, n, i);
        memcpy(out + *k, s + run, (size_t)(i - run));
        *k += i - run;
        if (s[i] == '"') {
            out[(*k)++] = '"';
            return i + 1;
        }
        int64_t escaped = oj_escaped(s, &i);
        if (escaped < 0)
            return -1;
        uint32_t cp = (uint32_t)escaped;
        const char *esc = cp == '"' ? "\\\"" : cp == '\\' ? "\\\\" : cp == '\b' ? "\\b" : cp == '\f' ? "\\f"
                        : cp == '\n' ? "\\n" : cp == '\r' ? "\\r" : cp == '\t' ? "\\t" : NULL;
        if (esc != NULL) {
            out[(*k)++] = (unsigned char)esc[0];
            out[(*k)++] = (unsigned char)esc[1];
        }
        else if (cp < 0x20) {
            memcpy(out + *k, "\\u00", 4);
            out[*k + 4] = (unsigned char)oj_hexdigits[cp >> 4];
            out[*k + 5] = (unsigned char)oj_hexdigits[cp & 15];
            *k += 6;
        }
        else {
            *k = oj_put_utf8(out, *k, cp);
        }
    }
}

typedef struct {
    Py_ssize_t key, key_end, value; /* the key token (quotes included) and where its value starts */
} OJMember;

static int
oj_key_cmp(const unsigned char *s, const OJMember *a, const OJMember *b)
{
    Py_ssize_t la = a->key_end - a->key - 2, lb = b->key_end - b->key - 2;
    int c = memcmp(s + a->key + 1, s + b->key + 1, (size_t)(la < lb ? la : lb));
    return c != 0 ? c : (la > lb) - (la < lb);
}

/* The canonical JSON of the validated value at s[i] into out[*k...] (never longer than the
 * value's own JSON): the index after the value, or -1 where this leaves it to Python: a float
 * (its repr is Python's), an object with a duplicate key, an escaped key or more than
 * OJ_MAX_SORTED_MEMBERS members, a lone surrogate. Keys sort as Python sorts str, by code
 * point, which is the order of their UTF-8 bytes. */
static Py_ssize_t
oj_canonical(const unsigned char *s, Py_ssize_t n, Py_ssize_t i, unsigned char *out, Py_ssize_t *k)
{
    unsigned char c = s[i];
    if (c == '"')
        return oj_canonical_string(s, n, i, out, k);
    if (c == '[') {
        out[(*k)++] = '[';
        i = oj_ws(s, n, i + 1);
        if (s[i] == ']') {
            out[(*k)++] = ']';
            return i + 1;
        }
        for (;;) {
            if ((i = oj_canonical(s, n, i, out, k)) < 0)
                return -1;
            i = oj_ws(s, n, i);
            out[(*k)++] = s[i];
            if (s[i] == ']')
                return i + 1;
            i = oj_ws(s, n, i + 1);
        }
    }
    if (c == '{') {
        OJMember members[OJ_MAX_SORTED_MEMBERS];
        int count = 0;
        i = oj_ws(s, n, i + 1);
        while (s[i] != '}') {
            if (count == OJ_MAX_SORTED_MEMBERS)
                return -1;
            OJMember *m = &members[count++];
            int escaped = 0;
            m->key = i;
            m->key_end = oj_string(s, n, i, &escaped);
            if (escaped)
                return -1;
            m->value = oj_ws(s, n, oj_ws(s, n, m->key_end) + 1);
            i = oj_ws(s, n, oj_skip(s, n, m->value));
            if (s[i] == ',')
                i = oj_ws(s, n, i + 1);
        }
        Py_ssize_t end = i + 1;
        for (int a = 1; a < count; a++) { /* insertion sort: a handful of members */
            OJMember m = members[a];
            int b = a - 1;
            for (; b >= 0 && oj_key_cmp(s, &members[b], &m) > 0; b--)
                members[b + 1] = members[b];
            members[b + 1] = m;
        }
        out[(*k)++] = '{';
        for (int a = 0; a < count; a++) {
            if (a > 0 && oj_key_cmp(s, &members[a - 1], &members[a]) == 0)
                return -1; /* a dict keeps the last value: left to Python */
            if (a > 0)
                out[(*k)++] = ',';
            memcpy(out + *k, s + members[a].key, (size_t)(members[a].key_end - members[a].key));
            *k += members[a].key_end - members[a].key;
            out[(*k)++] = ':';
            if (oj_canonical(s, n, members[a].value, out, k) < 0)
                return -1;
        }
        out[(*k)++] = '}';
        return end;
    }
    if (c == 't' || c == 'f' || c == 'n') {
        Py_ssize_t len = c == 'f' ? 5 : 4;
        memcpy(out + *k, s + i, (size_t)len);
        *k += len;
        return i + len;
    }
    int integer = 0;
    Py_ssize_t end = oj_number(s, n, i, &integer);
    if (!integer)
        return -1;
    if (end - i == 2 && s[i] == '-' && s[i + 1] == '0') { /* int("-0") is 0 */
        out[(*k)++] = '0';
        return end;
    }
    memcpy(out + *k, s + i, (size_t)(end - i));
    *k += end - i;
    return end;
}

/* A message's content as render_messages' _content_text reads it: a string, null, or a list
 * of parts, {"type": "text", "text": str} as its text and any other object as its canonical
 * JSON. 0, or -1 where it would raise or this leaves it to Python. */
static int
oj_content(const unsigned char *s, Py_ssize_t n, OJSpan v, unsigned char *out, Py_ssize_t *k)
{
    static const char *const part_names[] = {"type", "text"};
    if (v.start < 0 || s[v.start] == 'n')
        return 0;
    if (s[v.start] == '"')
        return oj_unescape(s, n, v.start, out, k) < 0 ? -1 : 0;
    if (s[v.start] != '[')
        return -1;
    Py_ssize_t i = oj_ws(s, n, v.start + 1);
    if (s[i] == ']')
        return 0;
    for (;;) {
        OJSpan part[2];
        Py_ssize_t start = i;
        if (s[i] != '{' || (i = oj_members(s, n, i, part_names, part, 2)) < 0)
            return -1;
        if (part[0].start >= 0 && oj_is_text(s, part[0])) {
            if (part[1].start < 0 || s[part[1].start] != '"' || oj_unescape(s, n, part[1].start, out, k) < 0)
                return -1;
        }
        else if (part[0].start >= 0 && s[part[0].start] == '"' && memchr(s + part[0].start, '\\', (size_t)(part[0].end - part[0].start))) {
            return -1; /* a "type" that might spell "text" */
        }
        else if (oj_canonical(s, n, start, out, k) < 0) {
            return -1;
        }
        i = oj_ws(s, n, i);
        if (s[i] == ']')
            return 0;
        i = oj_ws(s, n, i + 1);
    }
}

/* Whether the validated value at v is one Python finds false (`if calls:`): null, false, "",
 * [], {} or the integer 0 (a float is left to the canonical rendering, which declines it). */
static int
oj_falsy(const unsigned char *s, Py_ssize_t n, OJSpan v)
{
    if (v.start < 0)
        return 1;
    unsigned char c = s[v.start];
    if (c == 'n' || c == 'f')
        return 1;
    if (c == '"')
        return v.end - v.start == 2;
    if (c == '[' || c == '{')
        return s[oj_ws(s, n, v.start + 1)] == (c == '[' ? ']' : '}');
    Py_ssize_t digits = v.start + (c == '-');
    return v.end - digits == 1 && s[digits] == '0';
}

/* render_messages of the validated array at v: 0, or -1 where it would raise or render
 * something this reader leaves to it. */
static int
oj_render_messages(const unsigned char *s, Py_ssize_t n, OJSpan v, unsigned char *out, Py_ssize_t *k)
{
    static const char *const names[] = {"role", "content", "tool_calls"};
    if (s[v.start] != '[')
        return -1;
    Py_ssize_t i = oj_ws(s, n, v.start + 1);
    if (s[i] == ']')
        return -1; /* messages: expected a non-empty list */
    for (;;) {
        OJSpan m[3];
        if (s[i] != '{' || (i = oj_members(s, n, i, names, m, 3)) < 0)
            return -1;
        if (m[0].start < 0 || s[m[0].start] != '"' || m[0].end - m[0].start == 2)
            return -1;
        out[(*k)++] = '<';
        out[(*k)++] = '|';
        if (oj_unescape(s, n, m[0].start, out, k) < 0)
            return -1;
        out[(*k)++] = '|';
        out[(*k)++] = '>';
        out[(*k)++] = '\n';
        if (oj_content(s, n, m[1], out, k) < 0)
            return -1;
        if (!oj_falsy(s, n, m[2]) && oj_canonical(s, n, m[2].start, out, k) < 0)
            return -1;
        out[(*k)++] = '\n';
        i = oj_ws(s, n, i);
        if (s[i] == ']')
            return 0;
        i = oj_ws(s, n, i + 1);
    }
}

/* The validated array at v as token ids (little-endian uint32s into out): their count, or -1
 * unless it is a non-empty list of integers in [0, 2**32) (-0 is 0, as int("-0") is). */
static Py_ssize_t
oj_token_ids(const unsigned char *s, Py_ssize_t n, OJSpan v, unsigned char *out)
{
    Py_ssize_t i = oj_ws(s, n, v.start + 1), count = 0;
    if (s[i] == ']')
        return -1;
    for (;;) {
        int integer = 0;
        Py_ssize_t end = (s[i] == '-' || (s[i] >= '0' && s[i] <= '9')) ? oj_number(s, n, i, &integer) : -1;
        if (end < 0 || !integer)
            return -1;
        Py_ssize_t d = i;
        if (s[d] == '-') {
            if (end - d != 2 || s[d + 1] != '0')
                return -1;
            d++;
        }
        uint64_t t = 0;
        for (; d < end; d++)
            t = t * 10 + (uint64_t)(s[d] - '0');
        if (end - i > 10 || t > 0xFFFFFFFFull)
            return -1;
        out[4 * count] = (unsigned char)t;
        out[4 * count + 1] = (unsigned char)(t >> 8);
        out[4 * count + 2] = (unsigned char)(t >> 16);
        out[4 * count + 3] = (unsigned char)(t >> 24);
        count++;
        i = oj_ws(s, n, end);
        if (s[i] == ']')
            return count;
        i = oj_ws(s, n, i + 1);
    }
}

/* Validates the body as one strict-JSON object and finds its top-level members `model`,
 * `prompt` and `messages` (the last of each). 0, or -1 where Python must judge the body. */
static int
oj_top(const unsigned char *s, Py_ssize_t n, OJSpan *members)
{
    static const char *const names[] = {"model", "prompt", "messages"};
    for (int m = 0; m < 3; m++)
        members[m].start = members[m].end = -1;
    Py_ssize_t i = oj_ws(s, n, 0);
    if (i >= n || s[i] != '{')
        return -1;
    i = oj_ws(s, n, i + 1);
    if (i < n && s[i] == '}')
        i++;
    else {
        for (;;) {
            int escaped = 0;
            Py_ssize_t key = i;
            if (i >= n || s[i] != '"' || (i = oj_string(s, n, i, &escaped)) < 0 || escaped)
                return -1; /* invalid, or a key that might spell one of the names */
            Py_ssize_t key_end = i;
            i = oj_ws(s, n, i);
            if (i >= n || s[i] != ':')
                return -1;
            Py_ssize_t value = oj_ws(s, n, i + 1);
            if ((i = oj_value(s, n, value, 1)) < 0)
                return -1;
            for (int m = 0; m < 3; m++) {
                if (oj_key_is(s, key, key_end, names[m])) {
                    members[m].start = value;
                    members[m].end = i;
                }
            }
            i = oj_ws(s, n, i);
            if (i < n && s[i] == ',')
                i = oj_ws(s, n, i + 1);
            else if (i < n && s[i] == '}') {
                i++;
                break;
            }
            else
                return -1;
        }
    }
    if (oj_ws(s, n, i) != n)
        return -1;
    return members[0].start >= 0 && s[members[0].start] != '"' ? -1 : 0; /* model: expected a string */
}

static PyObject *
openai_prompt(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyBytes_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "takes 2 arguments: (body: bytes, chat: bool)");
        return NULL;
    }
    int chat = PyObject_IsTrue(args[1]);
    if (chat < 0)
        return NULL;
    /* the body is immutable and the caller holds it: read without the GIL */
    const unsigned char *s = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]);
    OJSpan members[3];
    int valid;
    Py_BEGIN_ALLOW_THREADS
    valid = oj_top(s, n, members);
    Py_END_ALLOW_THREADS
    OJSpan prompt = members[chat ? 2 : 1];
    if (valid < 0 || prompt.start < 0 || (s[prompt.start] != '"' && s[prompt.start] != '[')
        || (chat && s[prompt.start] != '['))
        Py_RETURN_NONE;
    int ids = !chat && s[prompt.start] == '[';
    Py_ssize_t span = prompt.end - prompt.start;
    /* upper bounds: a token id takes at least 2 bytes with its comma; rendered text is never
     * longer than its JSON (each message's markers are shorter than its braces and keys) */
    Py_ssize_t cap = ids ? (span / 2 + 1) * 4 : span + 4;
    PyObject *payload = PyBytes_FromStringAndSize(NULL, cap);
    if (payload == NULL)
        return NULL;
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(payload);
    Py_ssize_t length = 0, size = 0;
    Py_BEGIN_ALLOW_THREADS
    if (ids) {
        length = oj_token_ids(s, n, prompt, out);
        size = length * 4;
    }
    else {
        int ok = chat ? oj_render_messages(s, n, prompt, out, &length) : (oj_unescape(s, n, prompt.start, out, &length) < 0 ? -1 : 0);
        if (ok < 0) {
            length = -1;
        }
        else {
            size = length;
            while (size % 4)
                out[size++] = 0;
        }
    }
    Py_END_ALLOW_THREADS
    if (length < 0) {
        Py_DECREF(payload);
        Py_RETURN_NONE;
    }
    if (_PyBytes_Resize(&payload, size) < 0)
        return NULL;
    return Py_BuildValue("(nnONn)", members[0].start, members[0].end, ids ? Py_False : Py_True, payload, length);
}

_Static_assert(sizeof(unsigned long) == sizeof(uint64_t), "PyLong_AsUnsignedLong reads a uint64");

/* u64_array(values) -> array('Q') | None
 *
 * array('Q', values) for a tuple or list of ints. Router._prepare_stored packs every stored
 * event's engine hashes so (the range check before a batch changes anything), and array's
 * generic per-item conversion cost ~130 instructions a hash (issue #12). OverflowError for a
 * value outside [0, 2**64), as array('Q') raises; None for anything else (another iterable, an
 * item that is not exactly an int: a bool, a float), which the caller hands to array('Q')
 * itself, so its errors stay array's. */
static PyObject *
u64_array(PyObject *module, PyObject *values)
{
    if (!PyTuple_CheckExact(values) && !PyList_CheckExact(values))
        Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(values);
    /* array's own repeat makes an array of n without array()'s argument parsing (~1,600
     * instructions an array) */
    PyObject *packed = PySequence_Repeat(array_q_zero, n);
    if (packed == NULL)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(packed, &view, PyBUF_WRITABLE) < 0) {
        Py_DECREF(packed);
        return NULL;
    }
    uint64_t *out = view.buf;
    PyObject **items = PySequence_Fast_ITEMS(values); /* reading exact ints runs no Python code */
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long v;
        if (!PyLong_CheckExact(items[i]) || ((v = PyLong_AsUnsignedLong(items[i])) == (unsigned long)-1 && PyErr_Occurred())) {
            int error = PyErr_Occurred() != NULL;
            PyBuffer_Release(&view);
            Py_DECREF(packed);
            if (error)
                return NULL;
            Py_RETURN_NONE;
        }
        out[i] = (uint64_t)v; /* a loop over the int's digits */
    }
    PyBuffer_Release(&view);
    return packed;
}

/* (now, hits + 1) of a pending access `up` ((time, hits), or NULL: none yet) as a new reference;
 * None (borrowed) when `up` is not such a pair, NULL with an error */
static PyObject *
touched_pending(PyObject *up, PyObject *now)
{
    long long hits = 0;
    if (up != NULL && (!PyTuple_CheckExact(up) || PyTuple_GET_SIZE(up) != 2 || !PyLong_CheckExact(PyTuple_GET_ITEM(up, 1))
                       || exact_long(PyTuple_GET_ITEM(up, 1), &hits) || hits == LLONG_MAX))
        return Py_None;
    PyObject *count = PyLong_FromLongLong(hits + 1);
    if (count == NULL)
        return NULL;
    PyObject *pair = PyTuple_Pack(2, now, count);
    Py_DECREF(count);
    return pair;
}

/* touch_pending(pending, slot, node, now) -> None | NotImplemented: RadixIndex.touch_path's
 * access of the matched path's last block `node` by `slot`, kept pending in index._pending
 * (`pending`) on it (RadixIndex._touch_py is the reference): (now, hits + 1) there for a block
 * only `slot` holds, under the slot in a dict of them for a shared one, nothing for a block the
 * slot does not hold. NotImplemented for what the reference must do: a Python block, holders or
 * a slot not a non-negative int, an entry there not of the shape it keeps. */
static PyObject *
touch_pending(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "touch_pending takes 4 arguments (see RadixIndex._touch_py)");
        return NULL;
    }
    PyObject *table = args[0], *slotobj = args[1], *node = args[2], *now = args[3];
    long long slot;
    int has, holders;
    if (!PyDict_CheckExact(table) || !IS_BLOCK(node) || !PyLong_CheckExact(slotobj) || exact_long(slotobj, &slot)
        || slot < 0 || (holders = holders_read(BLOCK(node)->state->holders, (Py_ssize_t)slot, &has)) < 0)
        Py_RETURN_NOTIMPLEMENTED;
    if (!has)
        Py_RETURN_NONE;
    PyObject *up = PyDict_GetItemWithError(table, node); /* borrowed */
    if (up == NULL && PyErr_Occurred())
        return NULL;
    PyObject *into = table, *key = node, *inner = NULL, *value;
    if (holders == 2) { /* shared: the slot's own entry in the block's dict */
        if (up == NULL)
            into = inner = PyDict_New();
        else if (!PyDict_CheckExact(up))
            Py_RETURN_NOTIMPLEMENTED;
        else
            into = up;
        if (into == NULL)
            return NULL;
        key = slotobj;
        up = inner != NULL ? NULL : PyDict_GetItemWithError(up, slotobj);
        if (up == NULL && PyErr_Occurred())
            return NULL;
    }
    if ((value = touched_pending(up, now)) == Py_None) {
        Py_XDECREF(inner);
        Py_RETURN_NOTIMPLEMENTED;
    }
    int r = value == NULL || PyDict_SetItem(into, key, value) < 0 || (inner != NULL && PyDict_SetItem(table, node, inner) < 0);
    Py_XDECREF(value);
    Py_XDECREF(inner);
    if (r)
        return NULL;
    Py_RETURN_NONE;
}

/* set_leaf_recency(fn): `fn` is RadixIndex.recency (radix.py registers it), the priority
 * LeafOrder.stored computes itself for a leaf with no children and no pending accesses
 * (leaf_recency); any other priority is called as it is */
static PyObject *
set_leaf_recency(PyObject *module, PyObject *fn)
{
    Py_XSETREF(leaf_recency_ref, Py_NewRef(fn));
    Py_RETURN_NONE;
}

/* msgpack_uint32s(raw) -> bytes | None
 *
 * A msgpack array of ints in [0, 2**32) (vLLM's and SGLang's BlockStored token_ids, handed over
 * undecoded as a msgspec.Raw) as little-endian uint32 bytes, without an int object per token:
 * decoding the list with msgspec and packing it with array('I') cost ~90 ns a token, so a
 * 1M-token scheduler step held the routing loop ~110 ms (issue #16 item 1). Reads every int
 * encoding msgpack has; None for anything else (another type, a negative or larger int, bytes
 * after the array, a truncated one), which the caller then decodes with msgspec so that its
 * errors, and what the event is counted as, stay exactly what they were. */
static void
mp_be(const unsigned char *p, int width, uint64_t *value)
{
    uint64_t v = 0;
    for (int i = 0; i < width; i++)
        v = (v << 8) | p[i];
    *value = v;
}

static Py_ssize_t
mp_uint32s(const unsigned char *p, Py_ssize_t n, Py_ssize_t count, unsigned char *out)
{
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (at >= n)
            return -1;
        unsigned char tag = p[at++];
        uint64_t v;
        int width, is_signed = 0;
        if (tag <= 0x7f) {
            v = tag;
            width = 0;
        }
        else if (tag >= 0xcc && tag <= 0xcf) {
            width = 1 << (tag - 0xcc);
        }
        else if (tag >= 0xd0 && tag <= 0xd3) {
            width = 1 << (tag - 0xd0);
            is_signed = 1;
        }
        else {
            return -1; /* a negative fixint, or not an int */
        }
        if (width) {
            if (n - at < width)
                return -1;
            mp_be(p + at, width, &v);
            at += width;
            if (is_signed && (v >> (8 * width - 1)) & 1)
                return -1; /* negative */
        }
        if (v > UINT32_MAX)
            return -1;
        out[4 * i] = (unsigned char)v;
        out[4 * i + 1] = (unsigned char)(v >> 8);
        out[4 * i + 2] = (unsigned char)(v >> 16);
        out[4 * i + 3] = (unsigned char)(v >> 24);
    }
    return at;
}

static PyObject *
msgpack_uint32s(PyObject *module, PyObject *raw)
{
    Py_buffer view;
    if (PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *p = view.buf;
    Py_ssize_t n = view.len, at = 1;
    uint64_t count = 0;
    if (n < 1) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    if (p[0] >= 0x90 && p[0] <= 0x9f) {
        count = p[0] & 0x0f;
    }
    else if ((p[0] == 0xdc && n >= 3) || (p[0] == 0xdd && n >= 5)) {
        int width = p[0] == 0xdc ? 2 : 4;
        mp_be(p + 1, width, &count);
        at += width;
    }
    else {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    /* every int takes a byte at least: a header claiming more than the bytes hold is refused
     * before anything is allocated */
    if (count > (uint64_t)(n - at)) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    PyObject *packed = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)count * 4);
    if (packed == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_ssize_t used;
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(packed);
    if (count >= 16384) {
        /* the view keeps the buffer alive and msgspec.Raw / bytes are immutable */
        Py_BEGIN_ALLOW_THREADS
        used = mp_uint32s(p + at, n - at, (Py_ssize_t)count, out);
        Py_END_ALLOW_THREADS
    }
    else {
        used = mp_uint32s(p + at, n - at, (Py_ssize_t)count, out);
    }
    PyBuffer_Release(&view);
    if (used != n - at) {
        Py_DECREF(packed);
        Py_RETURN_NONE;
    }
    return packed;
}

/* ---- an engine batch's Stored events, a run of them in one call ---------------------------------
 *
 * Router.apply's per-event Python (EventApplier: checking each event, resolving its parent,
 * RadixIndex.store_hashed, the eviction hook's calls) was ~290 instructions of a 32-block event's
 * every block (issue #30 point 2). For the plain events engines send (tokens as bytes, pages the
 * router's blocks, no hybrid group, no extra keys) the check is events_plain and the rest
 * BlockTable.store_events, each one call per batch; everything else stays EventApplier's Python,
 * the reference a hypothesis test holds these to. Stored's fields are read at the offsets of its
 * slots (set_event_types), as attribute lookup would read them. */

static PyTypeObject *ev_stored_type, *ev_removed_type, *ev_cleared_type;
enum { EV_TOKENS, EV_HASHES, EV_PARENT, EV_BLOCK_SIZE, EV_MODEL, EV_LORA, EV_GROUP, EV_SALT, EV_EXTRAS, EV_FIELDS };
static const char *const ev_field_names[EV_FIELDS] = {
    "token_ids", "engine_hashes", "parent_engine_hash", "block_size", "model", "lora", "group", "salt", "extra_hashes",
};
static Py_ssize_t ev_offsets[EV_FIELDS];
static Py_ssize_t ev_removed_group; /* Removed.group's offset */

/* the seed of an unsalted chain from the root (index.keys.ROOT_SEED: "kvrouter") */
#define ROOT_SEED 0x6B76726F75746572ULL

/* set_event_types(Stored, Removed, Cleared): the core event classes events_plain and
 * store_events read (router/events.py registers them) */
static PyObject *
set_event_types(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyType_Check(args[0]) || !PyType_Check(args[1]) || !PyType_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "set_event_types(Stored, Removed, Cleared)");
        return NULL;
    }
    Py_ssize_t offsets[EV_FIELDS];
    for (int f = 0; f < EV_FIELDS; f++) {
        PyObject *name = PyUnicode_InternFromString(ev_field_names[f]);
        if (name == NULL)
            return NULL;
        offsets[f] = member_offset((PyTypeObject *)args[0], name);
        Py_DECREF(name);
        if (offsets[f] < 0) {
            PyErr_Format(PyExc_TypeError, "Stored.%s is not a slot", ev_field_names[f]);
            return NULL;
        }
    }
    PyObject *group = PyUnicode_InternFromString("group");
    if (group == NULL)
        return NULL;
    Py_ssize_t removed_group = member_offset((PyTypeObject *)args[1], group);
    Py_DECREF(group);
    if (removed_group < 0) {
        PyErr_SetString(PyExc_TypeError, "Removed.group is not a slot");
        return NULL;
    }
    memcpy(ev_offsets, offsets, sizeof offsets);
    ev_removed_group = removed_group;
    Py_XSETREF(ev_stored_type, (PyTypeObject *)Py_NewRef(args[0]));
    Py_XSETREF(ev_removed_type, (PyTypeObject *)Py_NewRef(args[1]));
    Py_XSETREF(ev_cleared_type, (PyTypeObject *)Py_NewRef(args[2]));
    Py_RETURN_NONE;
}

/* event field f, borrowed; NULL when the slot is unset */
static inline PyObject *
ev_field(PyObject *ev, int f)
{
    return *(PyObject **)((char *)ev + ev_offsets[f]);
}

/* `v` as a uint64 when it is exactly an int in [0, 2**64): 1, else 0 (no exception left) */
static inline int
ev_u64(PyObject *v, uint64_t *out)
{
    const digit *d;
    Py_ssize_t n;
    if (!PyLong_CheckExact(v) || (n = long_digits(v, &d)) < 0)
        return 0;
    /* the digits read in place (a third of PyLong_AsUnsignedLongLong's cost per engine hash) */
    uint64_t x = 0;
    while (n-- > 0) {
        if (x >> (64 - PyLong_SHIFT))
            return 0; /* 2**64 or more */
        x = x << PyLong_SHIFT | d[n];
    }
    *out = x;
    return 1;
}

/* a group (None, or exactly an int in [0, max_groups)) EventApplier accepts as it is: 1, else 0 */
static inline int
ev_group_ok(PyObject *group, long max_groups)
{
    if (group == Py_None)
        return 1;
    int overflow;
    long g = PyLong_CheckExact(group) ? PyLong_AsLongAndOverflow(group, &overflow) : -1;
    return !overflow && g >= 0 && g < max_groups;
}

/* grow *buf to hold n uint64s: 0, or -1 (MemoryError) */
static int
u64_room(uint64_t **buf, Py_ssize_t *cap, Py_ssize_t n)
{
    if (n <= *cap)
        return 0;
    Py_ssize_t want = n > 2 * *cap ? n : 2 * *cap;
    uint64_t *grown = PyMem_Realloc(*buf, (size_t)want * sizeof(uint64_t));
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *buf = grown;
    *cap = want;
    return 0;
}

/* A Stored event's pages (its token bytes' count of `page` or its own block_size tokens) when
 * EventApplier._prepare_stored accepts it with nothing converted: token bytes, a block_size
 * that is an int, engine hashes None (pages of block_size only) or a tuple or list of exact ints
 * in range, one a page (converted into *hashes_out, grown to hold them, when that is not NULL),
 * and a group it accepts; else 0, or -1 (MemoryError). */
static Py_ssize_t
ev_stored_pages(PyObject *ev, Py_ssize_t page, Py_ssize_t block_size, long max_groups, Py_ssize_t *own_page,
                uint64_t **hashes_out, Py_ssize_t *cap)
{
    PyObject *tokens = ev_field(ev, EV_TOKENS), *bs = ev_field(ev, EV_BLOCK_SIZE), *hashes = ev_field(ev, EV_HASHES);
    PyObject *group = ev_field(ev, EV_GROUP);
    if (tokens == NULL || bs == NULL || hashes == NULL || group == NULL || !PyBytes_CheckExact(tokens)
        || !PyLong_CheckExact(bs))
        return 0;
    int overflow;
    long b = PyLong_AsLongAndOverflow(bs, &overflow);
    if (overflow || b < 0 || b > PY_SSIZE_T_MAX / 4)
        return 0;
    Py_ssize_t p = b ? (Py_ssize_t)b : page, len = PyBytes_GET_SIZE(tokens);
    if (p <= 0 || len == 0 || len % (p * 4))
        return 0;
    Py_ssize_t pages = len / (p * 4);
    if (hashes == Py_None) {
        if (p != block_size)
            return 0;
    }
    else {
        if (!(PyTuple_CheckExact(hashes) || PyList_CheckExact(hashes)) || PySequence_Fast_GET_SIZE(hashes) != pages)
            return 0;
        PyObject **items = PySequence_Fast_ITEMS(hashes);
        uint64_t unused, *out = &unused;
        if (hashes_out != NULL) {
            if (u64_room(hashes_out, cap, pages) < 0)
                return -1;
            out = *hashes_out;
        }
        for (Py_ssize_t i = 0; i < pages; i++)
            if (!ev_u64(items[i], hashes_out != NULL ? &out[i] : out))
                return 0;
    }
    if (!ev_group_ok(group, max_groups))
        return 0;
    *own_page = p;
    return pages;
}

/* events_plain(events, page, block_size, max_groups) -> bool
 *
 * True when EventApplier.apply's check of every event of `events` (a tuple or list) would pass
 * with nothing rejected and nothing converted: exactly Stored events ev_stored_pages accepts
 * (`page`: the worker's page size, its spec's or the router's block size), Removed events with
 * a group it accepts, and Cleared ones. False leaves the check, and its messages, to the Python. */
static PyObject *
events_plain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "events_plain(events, page, block_size, max_groups)");
        return NULL;
    }
    if (ev_stored_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "events_plain: set_event_types was not called");
        return NULL;
    }
    PyObject *events = args[0];
    Py_ssize_t page = PyLong_AsSsize_t(args[1]), block_size = PyLong_AsSsize_t(args[2]);
    long max_groups = PyLong_AsLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyTuple_CheckExact(events) && !PyList_CheckExact(events))
        Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(events); i++) {
        PyObject *ev = PySequence_Fast_GET_ITEM(events, i);
        PyTypeObject *type = Py_TYPE(ev);
        Py_ssize_t own_page;
        if (type == ev_stored_type) {
            if (!ev_stored_pages(ev, page, block_size, max_groups, &own_page, NULL, NULL))
                Py_RETURN_FALSE;
        }
        else if (type == ev_removed_type) {
            PyObject *group = *(PyObject **)((char *)ev + ev_removed_group);
            if (group == NULL || !ev_group_ok(group, max_groups))
                Py_RETURN_FALSE;
        }
        else if (type != ev_cleared_type)
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* A chain's seed from the root for (model, lora, salt) (keys.namespace_seed): 1 with *seed; 0
 * when one is not a str UTF-8 encodes (the Python then raises what it raises). */
static int
namespace_seed_of(PyObject *model, PyObject *lora, PyObject *salt, uint64_t *seed)
{
    if (model == NULL || lora == NULL || salt == NULL || !PyUnicode_CheckExact(model) || !PyUnicode_CheckExact(lora)
        || !PyUnicode_CheckExact(salt))
        return 0;
    if (!PyUnicode_GET_LENGTH(model) && !PyUnicode_GET_LENGTH(lora) && !PyUnicode_GET_LENGTH(salt)) {
        *seed = ROOT_SEED;
        return 1;
    }
    Py_ssize_t nm, nl, ns;
    const char *m = PyUnicode_AsUTF8AndSize(model, &nm), *l = m ? PyUnicode_AsUTF8AndSize(lora, &nl) : NULL;
    const char *s = l ? PyUnicode_AsUTF8AndSize(salt, &ns) : NULL;
    if (s == NULL) {
        PyErr_Clear();
        return 0;
    }
    /* f"{model}\x00{lora}", then "\x00{salt}" when there is a salt */
    size_t len = (size_t)nm + 1 + (size_t)nl + (ns ? 1 + (size_t)ns : 0);
    char stack[256], *buf = len <= sizeof stack ? stack : PyMem_Malloc(len);
    if (buf == NULL) {
        PyErr_Clear();
        return 0;
    }
    memcpy(buf, m, (size_t)nm);
    buf[nm] = 0;
    memcpy(buf + nm + 1, l, (size_t)nl);
    if (ns) {
        buf[nm + 1 + nl] = 0;
        memcpy(buf + nm + 2 + nl, s, (size_t)ns);
    }
    *seed = XXH3_64bits_withSeed(buf, len, ROOT_SEED);
    if (buf != stack)
        PyMem_Free(buf);
    return 1;
}

/* An event's chain seed from the root (namespace_seed_of its model, lora and salt) */
static int
ev_root_seed(PyObject *ev, uint64_t *seed)
{
    return namespace_seed_of(ev_field(ev, EV_MODEL), ev_field(ev, EV_LORA), ev_field(ev, EV_SALT), seed);
}

/* a buffer of uint64s as store_run reads keys (never opened or closed: no export to release) */
static inline U64Keys
u64_keys_of(uint64_t *buf, Py_ssize_t n)
{
    U64Keys keys;
    memset(&keys, 0, sizeof keys);
    keys.view.obj = Py_None; /* only tested for NULL (buffer mode) */
    keys.view.buf = buf;
    keys.n = n;
    return keys;
}

/* array('Q') of buf[0:n] */
static PyObject *
u64_array_of(const uint64_t *buf, Py_ssize_t n)
{
    PyObject *out = PySequence_Repeat(array_q_zero, n);
    Py_buffer view;
    if (out == NULL || PyObject_GetBuffer(out, &view, PyBUF_WRITABLE) < 0) {
        Py_XDECREF(out);
        return NULL;
    }
    memcpy(view.buf, buf, (size_t)n * sizeof(uint64_t));
    PyBuffer_Release(&view);
    return out;
}

/* store_events(block_type, events, start, slot, now, block_size, page, leaves, pending, alone,
 *              counts, engine_map, reverse, order, priority, index, trace) -> (next, blocks, orphans, partial)
 *
 * EventApplier._apply_stored for each event of `events` from `start` on while they are plain
 * Stored events (ev_stored_pages, pages of `block_size`, no group, no extra hashes), for a
 * worker whose engine-hash map is the U64Map `engine_map` (and `reverse`, None or a U64Map, its
 * key -> engine hash map for eviction hints), with no speculative blocks live. Per event: the
 * parent resolved (an engine hash mapped to a block still indexed, else a key of ours the slot
 * holds, else the event's blocks are orphans), the keys hashed and stored (store_run, as
 * RadixIndex.store_hashed), the engine hashes mapped both ways, the eviction hook run as
 * order.stored(index, slot, blocks, priority) (order None: no hook); RadixIndex's counts are
 * added. `trace`, a list or None, gets (parent key, keys) for every event stored, for the
 * AccessInfo the Python reads afterwards. Returns the index of the first event not applied, the
 * blocks stored, the orphan blocks, and `partial`: None, or (keys, blocks, stop, parent_key) when
 * store_run left the event at `next` with its keys from `stop` on to the Python loop (its
 * hashes not mapped either way, its hook not run). */
static PyObject *
BlockTable_store_events(BlockTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 17) {
        PyErr_SetString(PyExc_TypeError, "store_events(block_type, events, start, slot, now, block_size, page, leaves, "
                                         "pending, alone, counts, engine_map, reverse, order, priority, index, trace)");
        return NULL;
    }
    PyObject *events = args[1], *counts = args[10], *engine_map = args[11], *reverse = args[12], *order = args[13];
    PyObject *priority = args[14], *index = args[15], *trace = args[16];
    if (ev_stored_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "store_events: set_event_types was not called");
        return NULL;
    }
    /* a tuple: nothing the hook's Python code does can take an event away mid-call */
    if (!PyTuple_CheckExact(events) || !PyDict_CheckExact(counts)
        || !Py_IS_TYPE(engine_map, &U64MapType) || (reverse != Py_None && !Py_IS_TYPE(reverse, &U64MapType))
        || (order != Py_None && !Py_IS_TYPE(order, &LeafOrderType))
        || (trace != Py_None && !PyList_CheckExact(trace))) {
        PyErr_SetString(PyExc_TypeError, "events a tuple, counts a dict, engine_map a U64Map, reverse None or a U64Map, "
                                         "order None or a LeafOrder, trace None or a list");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]), block_size = PyLong_AsSsize_t(args[5]);
    Py_ssize_t page = PyLong_AsSsize_t(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (block_size <= 0 || block_size > PY_SSIZE_T_MAX / 4) {
        PyErr_SetString(PyExc_ValueError, "block_size must be > 0");
        return NULL;
    }
    StoreRun r;
    PyObject *chain = PyList_New(0);
    if (chain == NULL)
        return NULL;
    if (store_run_open(&r, args[0], Py_None, NULL, args[3], args[4], args[7], chain, args[8], args[9]) < 0) {
        Py_DECREF(chain);
        return NULL;
    }
    U64Table *map = (U64Table *)engine_map;
    uint64_t *kbuf = NULL, *hbuf = NULL;
    Py_ssize_t kcap = 0, hcap = 0, blocks = 0, orphans = 0, i = start < 0 ? 0 : start;
    PyObject *partial = NULL, *result = NULL;
    int failed = 0;
    for (; i < PyTuple_GET_SIZE(events); i++) {
        PyObject *ev = PyTuple_GET_ITEM(events, i);
        Py_ssize_t own_page = 0, n = 0;
        if (Py_TYPE(ev) != ev_stored_type || ev_field(ev, EV_GROUP) != Py_None || ev_field(ev, EV_EXTRAS) != Py_None
            || (n = ev_stored_pages(ev, page, block_size, 1, &own_page, &hbuf, &hcap)) <= 0 || own_page != block_size) {
            failed = n < 0;
            break; /* EventApplier's Python applies it */
        }
        PyObject *hashes = ev_field(ev, EV_HASHES), *peh = ev_field(ev, EV_PARENT), *parent = Py_None;
        uint64_t seed;
        if (peh == NULL)
            break;
        if (peh == Py_None) {
            if (!ev_root_seed(ev, &seed))
                break;
        }
        else {
            if (!PyLong_CheckExact(peh))
                break;
            /* engine_keys.get(peh); else peh itself if the slot holds it (a publisher using our
             * keys); a mapped key whose block the router dropped itself counts as unknown */
            uint64_t ph, *mapped;
            uint64_t *at = NULL;
            if (ev_u64(peh, &ph)) {
                if ((mapped = us_find(&map->s, ph)) != NULL) {
                    seed = *mapped;
                    at = bt_find(t, seed);
                }
                else if ((at = bt_find(t, ph)) != NULL) {
                    int held = holders_has(BT_BLOCK(*at)->state->holders, r.slot, r.bit);
                    if (held < 0) {
                        failed = 1;
                        break;
                    }
                    seed = ph;
                    if (!held)
                        at = NULL;
                }
            }
            if (at == NULL) {
                orphans += n;
                continue;
            }
            parent = (PyObject *)BT_BLOCK(*at);
        }
        if (u64_room(&kbuf, &kcap, n) < 0) {
            failed = 1;
            break;
        }
        chain_into(PyBytes_AS_STRING(ev_field(ev, EV_TOKENS)), block_size * 4, n, seed, kbuf);
        U64Keys keys = u64_keys_of(kbuf, n);
        r.fresh = NULL;
        Py_ssize_t stop = store_run(t, parent, &keys, 0, &r);
        if (stop < 0) {
            failed = 1;
            break;
        }
        if (stop < n) { /* a block RadixIndex.store's Python loop stores: the rest is the caller's */
            PyObject *keys_array = u64_array_of(kbuf, n);
            if (keys_array == NULL) {
                failed = 1;
                break;
            }
            PyObject *parent_key = peh == Py_None ? Py_NewRef(Py_None) : PyLong_FromUnsignedLongLong(seed);
            partial = parent_key == NULL ? NULL : Py_BuildValue("(NOnN)", keys_array, chain, stop, parent_key);
            if (partial == NULL) {
                Py_XDECREF(keys_array);
                failed = 1;
            }
            break;
        }
        if (hashes != Py_None && (map_u64s(map, hbuf, kbuf, n) < 0
                                  || (reverse != Py_None && map_u64s((U64Table *)reverse, kbuf, hbuf, n) < 0))) {
            failed = 1;
            break;
        }
        if (order != Py_None && lo_stored((LeafOrder *)order, index, r.slot_obj, chain, priority, r.fresh) < 0) {
            failed = 1;
            break;
        }
        if (trace != Py_None) {
            PyObject *keys_array = u64_array_of(kbuf, n);
            PyObject *parent_key = peh == Py_None ? Py_NewRef(Py_None) : PyLong_FromUnsignedLongLong(seed);
            PyObject *entry = keys_array && parent_key ? PyTuple_Pack(2, parent_key, keys_array) : NULL;
            Py_XDECREF(keys_array);
            Py_XDECREF(parent_key);
            if (entry == NULL || PyList_Append(trace, entry) < 0) {
                Py_XDECREF(entry);
                failed = 1;
                break;
            }
            Py_DECREF(entry);
        }
        blocks += n;
        /* emptied for the next event, its item array kept (clearing it would free it and every
         * event would grow it again) */
        for (Py_ssize_t k = PyList_GET_SIZE(chain); k > 0; k--) {
            PyObject *item = PyList_GET_ITEM(chain, k - 1);
            Py_SET_SIZE(chain, k - 1);
            Py_DECREF(item);
        }
    }
    /* the counts RadixIndex.store adds, for what was stored, even when an error stopped the run */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    int counted = dict_add(counts, r.slot_obj, r.added) == 0 && dict_add(r.alone, r.bit, r.alone_n) == 0;
    if (type != NULL)
        PyErr_Restore(type, value, tb);
    if (!failed && counted)
        result = Py_BuildValue("(nnnO)", i, blocks, orphans, partial ? partial : Py_None);
    Py_XDECREF(partial);
    PyMem_Free(kbuf);
    PyMem_Free(hbuf);
    store_run_close(&r);
    Py_DECREF(chain);
    return result;
}

/* ---- deadline_verdict: deadline admission's price of every eligible worker ---------------------
 *
 * deadline_verdict(candidates, overlaps, claimed, prompt_tokens, block_size, now, chosen_id, slo_ms,
 *                  margin, levels, own_bare, own_by_tokens, prefill, backlog, anchored, anchor, queued,
 *                  queue_ttft, kv) -> (predicted, best, budget, meets) | NotImplemented
 *
 * The loop of deadline.py: DeadlineGuard.check, whose reference is DeadlineGuard._verdict_py (tests
 * hold the two to identical results): each candidate's predicted TTFT at the quantile against its
 * budget, the chosen one's prediction, the one overshooting least, and the ids of those that meet
 * theirs. Past capacity every Route's chosen worker misses its SLO, so every Route prices every
 * eligible worker: at 1,024 workers the bytecode loop was ~1.3 ms of each Route (kvrouterd bench
 * --only fleet, past_capacity). The rare steps stay in Python, called from here: `anchor(worker)`
 * when a load report came since the worker's books were anchored, `prefill(uncached, cached)` for
 * a prefix not priced yet this check (memoised in `own_by_tokens`), and `queued(id)` with
 * `queue_ttft(tokens, 0, requests - 1)` when the router keeps admission queues (`queued` None:
 * it does not). `kv` is None until a Complete taught the decode time, else (hold_ms, spread,
 * block_size, max_ms, waiting_tokens, waiting_count, flight): DeadlineGuard._kv_wait's inputs,
 * worked out here as there. NotImplemented (the caller runs the reference) when a value read is
 * not of the type the books keep: an int where ints are kept, an int or float for times. */
static PyObject *reported_running_name, *reported_at_name, *inflight_requests_name, *spec_name, *kv_utilization_name,
    *capacity_blocks_name, *block_size_name, *values_name;

typedef struct {
    double hold_ms, spread, max_ms;
    long long block_size;
    PyObject *waiting_tokens, *waiting_count, *flight; /* dicts, borrowed */
    PyTypeObject *spec_type;                          /* the class spec_*_at were found in */
    Py_ssize_t spec_block_size_at, spec_capacity_at;
} VerdictKv;

/* Where a candidate's class keeps what the pass reads: member offsets (-1: the generic lookup),
 * found once per class, as prefix_scan finds them; a Worker's in-flight count is a SlotLoad,
 * read by slot (`scan`). Read in place, the six attributes were most of the pass's time. */
typedef struct {
    PyTypeObject *type;
    ScanMembers scan;
    Py_ssize_t id_at, running_at, reported_at_at, kv_at, spec_at;
} VerdictMembers;

static void
verdict_members(VerdictMembers *m, PyTypeObject *type)
{
    m->type = type;
    scan_members(&m->scan, type, inflight_requests_name);
    m->id_at = member_offset(type, id_name);
    m->running_at = member_offset(type, reported_running_name);
    m->reported_at_at = member_offset(type, reported_at_name);
    m->kv_at = member_offset(type, kv_utilization_name);
    m->spec_at = member_offset(type, spec_name);
}

/* `v`, an exact int or float, as a double: 0, or 1 when it is neither or too big */
static inline int
verdict_double(PyObject *v, double *out)
{
    if (PyFloat_CheckExact(v)) {
        *out = PyFloat_AS_DOUBLE(v);
        return 0;
    }
    if (PyLong_CheckExact(v)) {
        long long n;
        if (exact_long(v, &n))
            return 1;
        *out = (double)n;
        return 0;
    }
    return 1;
}

/* obj.<name> (its member at `at`, see member_get) as a long long (an exact int): 0, 1 when it
 * is not one (NotImplemented), -1 on error */
static inline int
verdict_attr_long(PyObject *obj, Py_ssize_t at, PyObject *name, long long *out)
{
    PyObject *v = member_get(obj, at, name);
    if (v == NULL)
        return -1;
    int r = !PyLong_CheckExact(v) || exact_long(v, out);
    Py_DECREF(v);
    return r;
}

/* obj.<name> as a double (an exact int or float): 0, 1, -1 as verdict_attr_long */
static inline int
verdict_attr_double(PyObject *obj, Py_ssize_t at, PyObject *name, double *out)
{
    PyObject *v = member_get(obj, at, name);
    if (v == NULL)
        return -1;
    int r = verdict_double(v, out);
    Py_DECREF(v);
    return r;
}

/* dict[key] as a long long, `fallback` when absent: 0, 1 (not an exact int), -1 on error */
static inline int
verdict_dict_long(PyObject *dict, PyObject *key, long long fallback, long long *out)
{
    PyObject *v = PyDict_GetItemWithError(dict, key); /* borrowed */
    if (v == NULL) {
        *out = fallback;
        return PyErr_Occurred() ? -1 : 0;
    }
    return !PyLong_CheckExact(v) || exact_long(v, out);
}

static inline double verdict_max(double a, double b) { return b > a ? b : a; } /* Python's max(a, b) */
static inline double verdict_min(double a, double b) { return b < a ? b : a; } /* Python's min(a, b) */

/* DeadlineGuard._kv_wait(worker, now, tokens) into *out: 0, 1 (NotImplemented), -1 on error */
static int
verdict_kv_wait(VerdictKv *kv, const VerdictMembers *m, PyObject *worker, PyObject *wid, double now, long long tokens,
                double *out)
{
    *out = 0.0;
    PyObject *spec = member_get(worker, m->spec_at, spec_name);
    if (spec == NULL)
        return -1;
    if (Py_TYPE(spec) != kv->spec_type) {
        kv->spec_type = Py_TYPE(spec);
        kv->spec_block_size_at = member_offset(kv->spec_type, block_size_name);
        kv->spec_capacity_at = member_offset(kv->spec_type, capacity_blocks_name);
    }
    long long bs, blocks;
    int r = verdict_attr_long(spec, kv->spec_block_size_at, block_size_name, &bs);
    if (r == 0)
        r = verdict_attr_long(spec, kv->spec_capacity_at, capacity_blocks_name, &blocks);
    Py_DECREF(spec);
    if (r != 0)
        return r;
    if (!bs)
        bs = kv->block_size;
    long long capacity = blocks * bs;
    double used;
    if ((r = verdict_attr_double(worker, m->kv_at, kv_utilization_name, &used)) != 0)
        return r;
    if (!capacity || !kv->hold_ms || used <= 0.0)
        return 0;
    long long waiting;
    if ((r = verdict_dict_long(kv->waiting_tokens, wid, 0, &waiting)) != 0)
        return r;
    double deficit = (double)(waiting + tokens) - (1.0 - used) * (double)capacity;
    if (deficit <= 0)
        return 0;
    double turnover = verdict_min(deficit / (used * (double)capacity) * kv->hold_ms, kv->max_ms);
    if (kv->spread >= 1.0) {
        *out = turnover;
        return 0;
    }
    PyObject *flight = PyDict_GetItemWithError(kv->flight, wid); /* borrowed */
    if (flight == NULL && PyErr_Occurred())
        return -1;
    long long running = 0;
    if (flight != NULL) {
        Py_ssize_t size = PyObject_Length(flight);
        if (size < 0)
            return -1;
        long long counted;
        if ((r = verdict_dict_long(kv->waiting_count, wid, 0, &counted)) != 0)
            return r;
        running = size > 0 && size - counted > 0 ? size - counted : 0;
    }
    double oldest_first = kv->hold_ms; /* more than every running request holds: a full turnover at least */
    if (running > 0) {
        Py_INCREF(flight);
        PyObject *values = PyObject_CallMethodNoArgs(flight, values_name);
        Py_DECREF(flight);
        PyObject *it = values == NULL ? NULL : PyObject_GetIter(values);
        Py_XDECREF(values);
        if (it == NULL)
            return -1;
        long long freed = 0;
        PyObject *entry;
        r = 0;
        for (long long taken = 0; taken < running && (entry = PyIter_Next(it)) != NULL; taken++) {
            /* (own ms, dispatched at, uncached tokens held, first token at or 0) */
            long long held;
            double dispatched_at, first_at;
            if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 4 || !PyLong_CheckExact(PyTuple_GET_ITEM(entry, 2))
                || exact_long(PyTuple_GET_ITEM(entry, 2), &held) || verdict_double(PyTuple_GET_ITEM(entry, 1), &dispatched_at)
                || verdict_double(PyTuple_GET_ITEM(entry, 3), &first_at)) {
                Py_DECREF(entry);
                r = 1;
                break;
            }
            Py_DECREF(entry);
            freed += held;
            if ((double)freed >= deficit) {
                double from = first_at != 0.0 ? first_at : dispatched_at;
                oldest_first = verdict_min(verdict_max(0.0, from * 1000.0 + kv->hold_ms - now * 1000.0), kv->max_ms);
                break;
            }
        }
        Py_DECREF(it);
        if (r != 0 || PyErr_Occurred())
            return PyErr_Occurred() ? -1 : r;
    }
    *out = kv->spread * turnover + (1.0 - kv->spread) * oldest_first;
    return 0;
}

/* prefill(uncached, cached) of a prefix, memoised in own_by_tokens under (uncached, cached): 0,
 * 1 (NotImplemented: it priced a non-number), -1 on error */
static int
verdict_own(PyObject *own_by_tokens, PyObject *prefill, long long uncached, long long cached, double *out)
{
    PyObject *key = Py_BuildValue("(LL)", uncached, cached);
    if (key == NULL)
        return -1;
    PyObject *own = PyDict_GetItemWithError(own_by_tokens, key); /* borrowed */
    if (own != NULL) {
        Py_DECREF(key);
        return verdict_double(own, out);
    }
    if (PyErr_Occurred()) {
        Py_DECREF(key);
        return -1;
    }
    own = PyObject_Call(prefill, key, NULL);
    int r = own == NULL ? -1 : PyDict_SetItem(own_by_tokens, key, own);
    Py_DECREF(key);
    if (r == 0)
        r = verdict_double(own, out);
    Py_XDECREF(own);
    return r;
}

#define VERDICT_LEVELS 64

/* `w`'s in-flight count and load level (its reported running requests in powers of two, at most
 * `top`: deadline.py's _load_level): 0, 1 (NotImplemented), -1. A Worker's in-flight count is its
 * SlotLoad's, read by slot; anything else's by its attribute. */
static int
verdict_load(PyObject *w, const VerdictMembers *m, Py_ssize_t top, long long *inflight, Py_ssize_t *level)
{
    long long running, at_slot;
    int r = verdict_attr_long(w, m->running_at, reported_running_name, &running);
    if (r != 0)
        return r;
    if (running == LLONG_MIN) /* no magnitude below */
        return 1;
    if ((m->scan.slot_at < 0 || m->scan.loads_at < 0 || slot_member_load(w, &m->scan, &at_slot, inflight) != 0)
        && (r = verdict_attr_long(w, -1, inflight_requests_name, inflight)) != 0)
        return r;
    unsigned long long magnitude = running < 0 ? (unsigned long long)(-running) : (unsigned long long)running;
    *level = magnitude ? 64 - __builtin_clzll(magnitude) : 0; /* int.bit_length() */
    if (*level > top)
        *level = top;
    return 0;
}

/* DeadlineGuard._sync(w): `anchor(w)` when a load report came since `w`'s books were anchored
 * (in `anchored`, a dict); `anchor` NULL: the guard's own _anchor. 0, 1 (NotImplemented), -1 */
static PyObject *dl_anchor_name;

static int
verdict_sync(PyObject *anchored, PyObject *anchor, PyObject *guard, const VerdictMembers *m, PyObject *w, PyObject *wid)
{
    double reported_at, at_anchor = 0.0;
    int r = verdict_attr_double(w, m->reported_at_at, reported_at_name, &reported_at);
    if (r != 0)
        return r;
    PyObject *a = PyDict_GetItemWithError(anchored, wid); /* borrowed */
    if (a == NULL && PyErr_Occurred())
        return -1;
    if (a != NULL && verdict_double(a, &at_anchor))
        return 1;
    if (reported_at > at_anchor) {
        PyObject *done = anchor != NULL ? PyObject_CallOneArg(anchor, w) : PyObject_CallMethodOneArg(guard, dl_anchor_name, w);
        if (done == NULL)
            return -1;
        Py_DECREF(done);
    }
    return 0;
}

/* DeadlineGuard._drained: the backlog `backlog` (a dict) keeps for `wid`, drained to `now` at
 * `scale`: 0, 1 (NotImplemented), -1 */
static int
verdict_drained(PyObject *backlog, PyObject *wid, double now, double scale, double *out)
{
    double ms = 0.0, at = now;
    PyObject *books = PyDict_GetItemWithError(backlog, wid); /* borrowed */
    if (books == NULL && PyErr_Occurred())
        return -1;
    if (books != NULL && (!PyTuple_CheckExact(books) || PyTuple_GET_SIZE(books) != 2
                          || verdict_double(PyTuple_GET_ITEM(books, 0), &ms) || verdict_double(PyTuple_GET_ITEM(books, 1), &at)))
        return 1;
    *out = verdict_max(0.0, ms - (now - at) * 1000.0 / scale);
    return 0;
}

static PyObject *
deadline_verdict(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 19) {
        PyErr_SetString(PyExc_TypeError, "deadline_verdict takes 19 arguments (see DeadlineGuard._verdict_py)");
        return NULL;
    }
    PyObject *overlaps = args[1], *claimed = args[2], *chosen_id = args[6], *levels = args[9];
    PyObject *own_by_tokens = args[11], *prefill = args[12], *backlog = args[13], *anchored = args[14];
    PyObject *anchor = args[15], *queued = args[16], *queue_ttft = args[17], *kv_args = args[18];
    OverlapsObject *by_slot;
    long long prompt_tokens, block_size;
    double now, slo_ms, margin, own_bare;
    Py_ssize_t claim_count = PyObject_Length(claimed); /* ctx.claimed: a dict, or the empty MappingProxyType */
    if (claim_count < 0)
        return NULL;
    if (scan_overlaps(overlaps, &by_slot) || (claim_count && !PyDict_Check(claimed)) || !PyLong_CheckExact(args[3])
        || exact_long(args[3], &prompt_tokens) || !PyLong_CheckExact(args[4]) || exact_long(args[4], &block_size)
        || verdict_double(args[5], &now) || !PyUnicode_CheckExact(chosen_id) || verdict_double(args[7], &slo_ms)
        || verdict_double(args[8], &margin) || verdict_double(args[10], &own_bare) || !PyDict_CheckExact(own_by_tokens)
        || !PyDict_CheckExact(backlog) || !PyDict_CheckExact(anchored) || !PyList_CheckExact(levels)
        || PyList_GET_SIZE(levels) < 1 || PyList_GET_SIZE(levels) > VERDICT_LEVELS)
        Py_RETURN_NOTIMPLEMENTED;
    /* (scale, tail) per load level, read once */
    double scales[VERDICT_LEVELS], tails[VERDICT_LEVELS];
    Py_ssize_t top_level = PyList_GET_SIZE(levels) - 1;
    for (Py_ssize_t l = 0; l <= top_level; l++) {
        PyObject *pair = PyList_GET_ITEM(levels, l);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 || verdict_double(PyTuple_GET_ITEM(pair, 0), &scales[l])
            || verdict_double(PyTuple_GET_ITEM(pair, 1), &tails[l]))
            Py_RETURN_NOTIMPLEMENTED;
    }
    VerdictKv kv = {0.0, 1.0, 0.0, 0, NULL, NULL, NULL, NULL, -1, -1};
    VerdictMembers members = {NULL, {NULL, -1, -1, -1, 0}, -1, -1, -1, -1, -1};
    int kv_modelled = kv_args != Py_None;
    if (kv_modelled) {
        if (!PyTuple_CheckExact(kv_args) || PyTuple_GET_SIZE(kv_args) != 7 || verdict_double(PyTuple_GET_ITEM(kv_args, 0), &kv.hold_ms)
            || verdict_double(PyTuple_GET_ITEM(kv_args, 1), &kv.spread) || !PyLong_CheckExact(PyTuple_GET_ITEM(kv_args, 2))
            || exact_long(PyTuple_GET_ITEM(kv_args, 2), &kv.block_size) || verdict_double(PyTuple_GET_ITEM(kv_args, 3), &kv.max_ms)
            || !PyDict_CheckExact(PyTuple_GET_ITEM(kv_args, 4)) || !PyDict_CheckExact(PyTuple_GET_ITEM(kv_args, 5))
            || !PyDict_CheckExact(PyTuple_GET_ITEM(kv_args, 6)))
            Py_RETURN_NOTIMPLEMENTED;
        kv.waiting_tokens = PyTuple_GET_ITEM(kv_args, 4);
        kv.waiting_count = PyTuple_GET_ITEM(kv_args, 5);
        kv.flight = PyTuple_GET_ITEM(kv_args, 6);
    }
    int claims = claim_count > 0;
    long long bare = prompt_tokens > 0 ? prompt_tokens : 0;
    PyObject *seq = PySequence_Fast(args[0], "candidates must be a sequence");
    if (seq == NULL)
        return NULL;
    PyObject *meets = PyList_New(0);
    if (meets == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    double predicted = Py_HUGE_VAL, best = Py_HUGE_VAL, budget = slo_ms;
    PyObject *w = NULL, *wid = NULL, *slot = NULL;
    int r = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        w = Py_NewRef(PySequence_Fast_ITEMS(seq)[i]); /* a callback may drop the list's reference */
        if (Py_TYPE(w) != members.type)
            verdict_members(&members, Py_TYPE(w));
        wid = member_get(w, members.id_at, id_name);
        slot = wid == NULL ? NULL : member_get(w, members.scan.slot_at, slot_name);
        if (slot == NULL) {
            r = -1;
            break;
        }
        long long s, overlap = 0;
        if (!PyUnicode_CheckExact(wid) || !PyLong_CheckExact(slot) || exact_long(slot, &s)) {
            r = 1;
            break;
        }
        if ((r = scan_depth(overlaps, by_slot, slot, &overlap)) != 0)
            break;
        long long uncached = bare;
        double own = own_bare;
        if (overlap || claims) {
            long long held_back = 0;
            if (claims && (r = verdict_dict_long(claimed, slot, 0, &held_back)) != 0)
                break;
            long long cached = overlap - held_back;
            uncached = prompt_tokens - cached * block_size;
            if (uncached < 0)
                uncached = 0;
            if ((r = verdict_own(own_by_tokens, prefill, uncached, overlap * block_size, &own)) != 0)
                break;
        }
        long long inflight;
        Py_ssize_t level;
        if ((r = verdict_load(w, &members, top_level, &inflight, &level)) != 0)
            break;
        double scale = scales[level], tail = tails[level];
        double ahead = 0.0;
        if (inflight) {
            if ((r = verdict_sync(anchored, anchor, NULL, &members, w, wid)) != 0
                || (r = verdict_drained(backlog, wid, now, scale, &ahead)) != 0)
                break;
            if (kv_modelled) {
                double wait;
                if ((r = verdict_kv_wait(&kv, &members, w, wid, now, uncached, &wait)) != 0)
                    break;
                ahead = verdict_max(ahead, wait / scale);
            }
        }
        if (queued != Py_None) {
            PyObject *waiting = PyObject_CallOneArg(queued, wid);
            PyObject *requests = waiting == NULL ? NULL : PySequence_GetItem(waiting, 0);
            PyObject *tokens = requests == NULL ? NULL : PySequence_GetItem(waiting, 1);
            Py_XDECREF(waiting);
            int some = tokens == NULL ? -1 : PyObject_IsTrue(tokens);
            if (some > 0) {
                PyObject *before = PyNumber_Subtract(requests, one);
                PyObject *ms = before == NULL ? NULL : PyObject_CallFunctionObjArgs(queue_ttft, tokens, zero, before, NULL);
                Py_XDECREF(before);
                double queue_ms = 0.0;
                some = ms == NULL ? -1 : verdict_double(ms, &queue_ms) ? 2 : 0;
                Py_XDECREF(ms);
                ahead += queue_ms;
            }
            Py_XDECREF(requests);
            Py_XDECREF(tokens);
            if (some < 0 || some == 2) {
                r = some < 0 ? -1 : 1;
                break;
            }
        }
        tail *= margin;
        double t = (ahead + own) * tail; /* the prediction (ahead + own) * scale, at the quantile */
        double allowed = verdict_max(slo_ms, own * tail);
        int chosen = wid == chosen_id || PyUnicode_Compare(wid, chosen_id) == 0;
        if (chosen)
            predicted = (ahead + own) * scale;
        if (t - allowed < best - budget) {
            best = t;
            budget = allowed;
        }
        if (t <= allowed && PyList_Append(meets, wid) < 0) {
            r = -1;
            break;
        }
        Py_CLEAR(w);
        Py_CLEAR(wid);
        Py_CLEAR(slot);
    }
    Py_XDECREF(w);
    Py_XDECREF(wid);
    Py_XDECREF(slot);
    Py_DECREF(seq);
    if (r != 0) {
        Py_DECREF(meets);
        if (r < 0)
            return NULL;
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *result = Py_BuildValue("(dddN)", predicted, best, budget, meets);
    return result;
}

/* ---- deadline admission's books, one Route at a time ------------------------------------------
 *
 * deadline_price(guard, chosen, uncached, cached, now, slo_ms) -> Pricing | None | NotImplemented
 * deadline_dispatch(guard, worker, request_id, uncached, now, cached, priced) -> None | NotImplemented
 * deadline_complete(guard, request_id, ttft_ms, now, e2e_ms) -> None | NotImplemented
 *
 * What deadline.py's DeadlineGuard does for every Route and Complete: price_chosen with nothing
 * queued, on_dispatch and on_complete. Their references are _price_py, _dispatch_py and
 * _complete_py there; tests hold the two to the same answers and the same books over random
 * sequences of calls. In bytecode the three were ~9 us of the ~76 a streamed Route + Complete
 * takes in process (kvrouterd bench --only grpc, deadline_off by difference): ~20 dict and
 * OrderedDict steps, a few logs and exps, a dozen small calls. The books stay the guard's own
 * dicts, read and written here through its attributes, so the reference, the native verdict
 * (deadline_verdict) and everything else that reads them see one state. The rare steps call the
 * guard's own methods: _anchor after a load report, prefill_ms for a prompt not priced last,
 * _forget when the tracked requests overflow. NotImplemented (the caller runs the reference)
 * when a value read is not of the type the books keep; it is decided before any of the books is
 * written, though it may leave behind what the reference's own first steps would: a worker
 * re-anchored to its load report, the prefill memo. */
static PyObject *dl_levels_name, *dl_margin_name, *dl_anchored_name, *dl_backlog_name, *dl_hold_ms_name,
    *dl_hold_sq_name, *dl_waiting_tokens_name, *dl_waiting_count_name, *dl_flight_name, *dl_last_prefill_name,
    *dl_prefill_ms_name, *dl_predicted_name, *dl_where_name, *dl_forget_name, *dl_judged_name,
    *dl_quantile_name, *dl_log_margin_name, *dl_samples_name, *dl_scales_name, *dl_tails_name, *dl_popitem_name;

/* deadline.py's constants, handed over once at its import (deadline_constants) */
static struct {
    double scale_weight, log_scale_range, tail_step, margin_step, hold_weight, min_sample_ms, max_latency_ms;
    long long max_tracked, load_levels;
    int set;
} dl_k;

/* an exact int as a long long: 0, or 1 */
static inline int
dl_long_arg(PyObject *v, long long *out)
{
    return !PyLong_CheckExact(v) || exact_long(v, out);
}

static PyObject *
deadline_constants(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "deadline_constants takes 9 arguments (see deadline.py)");
        return NULL;
    }
    double d[7];
    long long tracked, levels;
    for (int i = 0; i < 7; i++)
        if (verdict_double(args[i], &d[i])) {
            PyErr_SetString(PyExc_TypeError, "deadline_constants: the first 7 must be numbers");
            return NULL;
        }
    if (dl_long_arg(args[7], &tracked) || dl_long_arg(args[8], &levels) || tracked < 1 || levels < 1 || levels > VERDICT_LEVELS) {
        PyErr_SetString(PyExc_ValueError, "deadline_constants: max_tracked >= 1, load_levels in [1, 64]");
        return NULL;
    }
    dl_k.scale_weight = d[0];
    dl_k.log_scale_range = d[1];
    dl_k.tail_step = d[2];
    dl_k.margin_step = d[3];
    dl_k.hold_weight = d[4];
    dl_k.min_sample_ms = d[5];
    dl_k.max_latency_ms = d[6];
    dl_k.max_tracked = tracked;
    dl_k.load_levels = levels;
    dl_k.set = 1;
    Py_RETURN_NONE;
}

/* What a Route's pricing reads of a worker, found per class (VerdictMembers), with its id */
typedef struct {
    VerdictMembers m;
    PyObject *wid; /* new reference */
    long long inflight;
    Py_ssize_t level;
} DlWorker;

/* `w`'s id, in-flight count and load level (of the guard's load_levels): 0, 1 (NotImplemented), -1 */
static int
dl_worker(DlWorker *d, PyObject *w)
{
    verdict_members(&d->m, Py_TYPE(w));
    d->wid = member_get(w, d->m.id_at, id_name);
    if (d->wid == NULL)
        return -1;
    if (!PyUnicode_CheckExact(d->wid))
        return 1;
    return verdict_load(w, &d->m, (Py_ssize_t)dl_k.load_levels - 1, &d->inflight, &d->level);
}

/* DeadlineGuard._sync(w), the guard's books read through its attributes: 0, 1, -1 */
static int
dl_sync(PyObject *guard, DlWorker *d, PyObject *w)
{
    PyObject *anchored = attr_get(guard, dl_anchored_name);
    if (anchored == NULL)
        return -1;
    int r = PyDict_CheckExact(anchored) ? verdict_sync(anchored, NULL, guard, &d->m, w, d->wid) : 1;
    Py_DECREF(anchored);
    return r;
}

/* (scale, tail) of load level `level` in the guard's _levels (load_levels of them): 0, 1, -1 */
static int
dl_level(PyObject *guard, Py_ssize_t level, double *scale, double *tail)
{
    PyObject *levels = attr_get(guard, dl_levels_name);
    if (levels == NULL)
        return -1;
    int r = 1;
    if (PyList_CheckExact(levels) && PyList_GET_SIZE(levels) == dl_k.load_levels && level < dl_k.load_levels) {
        PyObject *pair = PyList_GET_ITEM(levels, level);
        r = !PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 || verdict_double(PyTuple_GET_ITEM(pair, 0), scale)
            || verdict_double(PyTuple_GET_ITEM(pair, 1), tail);
    }
    Py_DECREF(levels);
    return r;
}

/* DeadlineGuard._waits(w, now, tokens, scale) of a worker with requests in flight, its books
 * synced: its backlog drained to now, and the larger of that and its wait for KV room: 0, 1, -1 */
static int
dl_waits(PyObject *guard, DlWorker *d, PyObject *w, double now, long long tokens, double scale, double *drained,
         double *waited)
{
    PyObject *backlog = attr_get(guard, dl_backlog_name);
    if (backlog == NULL)
        return -1;
    int r = PyDict_CheckExact(backlog) ? verdict_drained(backlog, d->wid, now, scale, drained) : 1;
    Py_DECREF(backlog);
    if (r != 0)
        return r;
    /* _kv_wait's inputs, as DeadlineGuard._verdict_args hands them to deadline_verdict */
    VerdictKv kv = {0.0, 1.0, dl_k.max_latency_ms, 0, NULL, NULL, NULL, NULL, -1, -1};
    double hold_sq = 0.0, wait = 0.0;
    PyObject *block_size = NULL;
    if ((r = verdict_attr_double(guard, attr_place(guard, dl_hold_ms_name), dl_hold_ms_name, &kv.hold_ms)) != 0)
        return r;
    if (kv.hold_ms) {
        if ((r = verdict_attr_double(guard, attr_place(guard, dl_hold_sq_name), dl_hold_sq_name, &hold_sq)) != 0)
            return r;
        kv.spread = verdict_min(1.0, verdict_max(0.0, hold_sq / (kv.hold_ms * kv.hold_ms) - 1.0)); /* _hold_spread */
        block_size = attr_get(guard, block_size_name);
        kv.waiting_tokens = block_size == NULL ? NULL : attr_get(guard, dl_waiting_tokens_name);
        kv.waiting_count = kv.waiting_tokens == NULL ? NULL : attr_get(guard, dl_waiting_count_name);
        kv.flight = kv.waiting_count == NULL ? NULL : attr_get(guard, dl_flight_name);
        if (kv.flight == NULL)
            r = -1;
        else if (!PyLong_CheckExact(block_size) || exact_long(block_size, &kv.block_size)
                 || !PyDict_CheckExact(kv.waiting_tokens) || !PyDict_CheckExact(kv.waiting_count)
                 || !PyDict_CheckExact(kv.flight))
            r = 1;
        else
            r = verdict_kv_wait(&kv, &d->m, w, d->wid, now, tokens, &wait);
        Py_XDECREF(block_size);
        Py_XDECREF(kv.waiting_tokens);
        Py_XDECREF(kv.waiting_count);
        Py_XDECREF(kv.flight);
        if (r != 0)
            return r;
    }
    *waited = verdict_max(*drained, wait / scale);
    return 0;
}

/* guard.prefill_ms(uncached, cached): its memo (_last_prefill) read here, else the method called */
static int
dl_prefill(PyObject *guard, long long uncached, long long cached, double *out)
{
    PyObject *last = attr_get(guard, dl_last_prefill_name);
    if (last == NULL)
        return -1;
    if (PyTuple_CheckExact(last) && PyTuple_GET_SIZE(last) == 2) {
        PyObject *tokens = PyTuple_GET_ITEM(last, 0);
        long long u, c;
        if (PyTuple_CheckExact(tokens) && PyTuple_GET_SIZE(tokens) == 2 && !dl_long_arg(PyTuple_GET_ITEM(tokens, 0), &u)
            && !dl_long_arg(PyTuple_GET_ITEM(tokens, 1), &c) && u == uncached && c == cached) {
            int r = verdict_double(PyTuple_GET_ITEM(last, 1), out);
            Py_DECREF(last);
            return r;
        }
    }
    Py_DECREF(last);
    PyObject *u = PyLong_FromLongLong(uncached), *c = u == NULL ? NULL : PyLong_FromLongLong(cached);
    PyObject *ms = c == NULL ? NULL : PyObject_CallMethodObjArgs(guard, dl_prefill_ms_name, u, c, NULL);
    Py_XDECREF(u);
    Py_XDECREF(c);
    if (ms == NULL)
        return -1;
    int r = verdict_double(ms, out);
    Py_DECREF(ms);
    return r;
}

/* a tuple of `n` new references, stolen (NULL where one could not be made: then NULL) */
static PyObject *
dl_tuple(Py_ssize_t n, PyObject **items)
{
    PyObject *t = NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (items[i] == NULL)
            goto fail;
    if ((t = PyTuple_New(n)) == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(t, i, items[i]);
    return t;
fail:
    for (Py_ssize_t i = 0; i < n; i++)
        Py_XDECREF(items[i]);
    return NULL;
}

/* price_chosen's answer for `chosen` (deadline_price below; the objects are the numbers as the
 * reference's Pricing holds them): a Pricing, None, NotImplemented, or NULL with an error */
static PyObject *
dl_price(PyObject *guard, PyObject *chosen, long long uncached, long long cached, double now, double slo_ms,
         PyObject *now_obj, PyObject *uncached_obj, PyObject *cached_obj)
{
    double margin, scale = 1.0, tail = 1.0;
    DlWorker d = {.wid = NULL};
    int r = dl_worker(&d, chosen);
    double drained = 0.0, waited = 0.0;
    if (r == 0 && d.inflight) {
        if ((r = dl_sync(guard, &d, chosen)) == 0 && (r = dl_level(guard, d.level, &scale, &tail)) == 0)
            r = dl_waits(guard, &d, chosen, now, uncached, scale, &drained, &waited);
    }
    Py_XDECREF(d.wid);
    double own = 0.0;
    int meets = 1;
    /* something ahead of it (only with requests in flight: `tail` was read with them): check's rule for one worker */
    if (r == 0 && !(waited <= 0.0)) {
        if ((r = dl_prefill(guard, uncached, cached, &own)) == 0
            && (r = verdict_attr_double(guard, attr_place(guard, dl_margin_name), dl_margin_name, &margin)) == 0) {
            tail *= margin;
            meets = (waited + own) * tail <= verdict_max(slo_ms, own * tail);
        }
    }
    if (r != 0) {
        if (r < 0)
            return NULL;
        Py_RETURN_NOTIMPLEMENTED;
    }
    if (!meets)
        Py_RETURN_NONE;
    PyObject *priced[] = {Py_NewRef(chosen), Py_NewRef(now_obj), Py_NewRef(uncached_obj), Py_NewRef(cached_obj),
                          PyFloat_FromDouble(drained), PyFloat_FromDouble(waited)};
    return dl_tuple(6, priced);
}

static PyObject *
deadline_price(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "deadline_price takes 6 arguments (see DeadlineGuard._price_py)");
        return NULL;
    }
    long long uncached, cached;
    double now, slo_ms;
    if (!dl_k.set || dl_long_arg(args[2], &uncached) || dl_long_arg(args[3], &cached) || verdict_double(args[4], &now)
        || verdict_double(args[5], &slo_ms))
        Py_RETURN_NOTIMPLEMENTED;
    return dl_price(args[0], args[1], uncached, cached, now, slo_ms, args[4], args[2], args[3]);
}

/* dict[key] = value (a new reference, stolen): 0, or -1 */
static int
dl_set_new(PyObject *dict, PyObject *key, PyObject *value)
{
    if (value == NULL)
        return -1;
    int r = PyObject_SetItem(dict, key, value); /* an OrderedDict's own, keeping its order */
    Py_DECREF(value);
    return r;
}

static PyObject *
deadline_dispatch(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "deadline_dispatch takes 7 arguments (see DeadlineGuard._dispatch_py)");
        return NULL;
    }
    PyObject *guard = args[0], *worker = args[1], *request_id = args[2], *now_obj = args[4], *priced = args[6];
    long long uncached, cached;
    double now, scale = 1.0, tail = 1.0;
    if (!dl_k.set || !PyUnicode_CheckExact(request_id) || dl_long_arg(args[3], &uncached) || verdict_double(now_obj, &now)
        || dl_long_arg(args[5], &cached) || (priced != Py_None && !(PyTuple_CheckExact(priced) && PyTuple_GET_SIZE(priced) == 6)))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *backlog = NULL, *waiting_tokens = NULL, *waiting_count = NULL, *predicted_d = NULL, *flight_d = NULL;
    PyObject *where = NULL, *flight = NULL;
    DlWorker d = {.wid = NULL};
    int r = dl_worker(&d, worker);
    /* the books written below, checked before anything runs that writes (a re-anchor, the prefill memo) */
    if (r == 0) {
        backlog = attr_get(guard, dl_backlog_name);
        waiting_tokens = backlog == NULL ? NULL : attr_get(guard, dl_waiting_tokens_name);
        waiting_count = waiting_tokens == NULL ? NULL : attr_get(guard, dl_waiting_count_name);
        predicted_d = waiting_count == NULL ? NULL : attr_get(guard, dl_predicted_name);
        flight_d = predicted_d == NULL ? NULL : attr_get(guard, dl_flight_name);
        where = flight_d == NULL ? NULL : attr_get(guard, dl_where_name);
        if (where == NULL)
            r = -1;
        else if (!PyDict_CheckExact(backlog) || !PyDict_CheckExact(waiting_tokens) || !PyDict_CheckExact(waiting_count)
                 || !PyODict_CheckExact(predicted_d) || !PyDict_CheckExact(flight_d) || !PyDict_CheckExact(where))
            r = 1;
    }
    if (r == 0)
        r = dl_sync(guard, &d, worker); /* before counting this request among those waiting */
    /* the worker's in-flight count already includes it: a first request finds no backlog */
    int first = d.inflight <= 1;
    double own = 0.0, predicted = 0.0, queued_ms = 0.0;
    if (r == 0)
        r = dl_prefill(guard, uncached, cached, &own);
    if (r == 0 && first)
        predicted = queued_ms = own;
    else if (r == 0) {
        long long pu, pc;
        double pnow, pdrained, pwaited;
        if (priced != Py_None && PyTuple_CheckExact(priced) && PyTuple_GET_SIZE(priced) == 6
            && PyTuple_GET_ITEM(priced, 0) == worker && !verdict_double(PyTuple_GET_ITEM(priced, 1), &pnow) && pnow == now
            && !dl_long_arg(PyTuple_GET_ITEM(priced, 2), &pu) && pu == uncached
            && !dl_long_arg(PyTuple_GET_ITEM(priced, 3), &pc) && pc == cached
            && !verdict_double(PyTuple_GET_ITEM(priced, 4), &pdrained)
            && !verdict_double(PyTuple_GET_ITEM(priced, 5), &pwaited)) {
            /* ahead_ms (nothing queued) and backlog_ms as admission found them */
            queued_ms = pdrained + own;
            predicted = pwaited + own;
        }
        else if ((r = dl_level(guard, d.level, &scale, &tail)) == 0
                 && (r = dl_waits(guard, &d, worker, now, uncached, scale, &pdrained, &pwaited)) == 0) {
            queued_ms = pdrained + own;
            predicted = pwaited + own;
        }
    }
    /* everything written below is read and checked first (these, as _anchor left them) */
    long long tokens_before = 0, count_before = 0;
    if (r == 0) {
        if (!first && ((r = verdict_dict_long(waiting_tokens, d.wid, 0, &tokens_before)) != 0
                       || (r = verdict_dict_long(waiting_count, d.wid, 0, &count_before)) != 0))
            ;
        else if (__builtin_add_overflow(tokens_before, uncached, &tokens_before)
                 || __builtin_add_overflow(count_before, 1, &count_before))
            r = 1;
        else if (PyUnicode_GET_LENGTH(request_id)) {
            flight = PyDict_GetItemWithError(flight_d, d.wid); /* borrowed */
            if (flight == NULL && PyErr_Occurred())
                r = -1;
            else if (flight != NULL && !PyODict_CheckExact(flight))
                r = 1;
            Py_XINCREF(flight);
        }
    }
    PyObject *books[] = {NULL, NULL};
    if (r == 0) {
        books[0] = PyFloat_FromDouble(queued_ms);
        books[1] = Py_NewRef(now_obj);
    }
    if (r == 0 && (dl_set_new(backlog, d.wid, dl_tuple(2, books)) < 0
                   || dl_set_new(waiting_tokens, d.wid, PyLong_FromLongLong(tokens_before)) < 0
                   || dl_set_new(waiting_count, d.wid, PyLong_FromLongLong(count_before)) < 0))
        r = -1;
    if (r == 0 && PyUnicode_GET_LENGTH(request_id)) { /* in model ms: what `scale` compares the observed TTFT with */
        PyObject *dispatched[] = {PyFloat_FromDouble(predicted), PyLong_FromLongLong(d.level)};
        if (dl_set_new(predicted_d, request_id, dl_tuple(2, dispatched)) < 0)
            r = -1;
        else if (PyDict_GET_SIZE(predicted_d) > dl_k.max_tracked) {
            PyObject *gone = PyObject_CallMethodOneArg(predicted_d, dl_popitem_name, Py_False);
            r = gone == NULL ? -1 : 0;
            Py_XDECREF(gone);
        }
        if (r == 0 && flight == NULL) {
            flight = PyODict_New();
            if (flight == NULL || PyDict_SetItem(flight_d, d.wid, flight) < 0)
                r = -1;
        }
        PyObject *entry[] = {NULL, NULL, NULL, NULL};
        if (r == 0) {
            entry[0] = PyFloat_FromDouble(own);
            entry[1] = Py_NewRef(now_obj);
            entry[2] = Py_NewRef(args[3]);
            entry[3] = Py_NewRef(float_zero);
        }
        if (r == 0 && (dl_set_new(flight, request_id, dl_tuple(4, entry)) < 0
                       || PyDict_SetItem(where, request_id, d.wid) < 0))
            r = -1;
        if (r == 0 && PyDict_GET_SIZE(where) > dl_k.max_tracked) {
            Py_ssize_t pos = 0;
            PyObject *oldest, *value;
            if (PyDict_Next(where, &pos, &oldest, &value)) {
                Py_INCREF(oldest);
                PyObject *done = PyObject_CallMethodOneArg(guard, dl_forget_name, oldest);
                Py_DECREF(oldest);
                r = done == NULL ? -1 : 0;
                Py_XDECREF(done);
            }
        }
    }
    Py_XDECREF(d.wid);
    Py_XDECREF(backlog);
    Py_XDECREF(waiting_tokens);
    Py_XDECREF(waiting_count);
    Py_XDECREF(predicted_d);
    Py_XDECREF(flight_d);
    Py_XDECREF(where);
    Py_XDECREF(flight);
    if (r != 0) {
        if (r < 0)
            return NULL;
        Py_RETURN_NOTIMPLEMENTED;
    }
    Py_RETURN_NONE;
}

/* a float attribute written: 0, or -1 */
static int
dl_set_double(PyObject *guard, PyObject *name, double value)
{
    PyObject *v = PyFloat_FromDouble(value);
    if (v == NULL)
        return -1;
    int r = attr_set(guard, name, v);
    Py_DECREF(v);
    return r;
}

static inline double dl_clamp(double x, double range) { return verdict_min(verdict_max(x, -range), range); }

static PyObject *
deadline_complete(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "deadline_complete takes 5 arguments (see DeadlineGuard._complete_py)");
        return NULL;
    }
    PyObject *guard = args[0], *request_id = args[1];
    double ttft, now = 0.0, e2e;
    int timed = args[3] != Py_None;
    if (!dl_k.set || !PyUnicode_CheckExact(request_id) || verdict_double(args[2], &ttft) || verdict_double(args[4], &e2e)
        || (timed && verdict_double(args[3], &now)))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *where = NULL, *flight_d = NULL, *judged_d = NULL, *predicted_d = NULL, *levels = NULL, *samples = NULL;
    PyObject *scales = NULL, *tails = NULL;
    where = attr_get(guard, dl_where_name);
    flight_d = where == NULL ? NULL : attr_get(guard, dl_flight_name);
    judged_d = flight_d == NULL ? NULL : attr_get(guard, dl_judged_name);
    predicted_d = judged_d == NULL ? NULL : attr_get(guard, dl_predicted_name);
    int r = predicted_d == NULL ? -1 : 0;
    if (r == 0 && (!PyDict_CheckExact(where) || !PyDict_CheckExact(flight_d) || !PyODict_CheckExact(judged_d)
                   || !PyODict_CheckExact(predicted_d)))
        r = 1;
    /* _forget's: the worker the request went to and its flight */
    PyObject *wid = NULL, *flight = NULL, *judged = NULL, *dispatched = NULL; /* borrowed */
    if (r == 0 && (wid = PyDict_GetItemWithError(where, request_id)) == NULL && PyErr_Occurred())
        r = -1;
    if (r == 0 && wid != NULL) {
        if (!PyUnicode_CheckExact(wid))
            r = 1;
        else if ((flight = PyDict_GetItemWithError(flight_d, wid)) == NULL && PyErr_Occurred())
            r = -1;
        else if (flight != NULL && !PyODict_CheckExact(flight))
            r = 1;
    }
    /* _learn's: the margin's step, then the corrections' */
    double quantile = 0.0, log_margin = 0.0, judged_slo = 0.0, judged_at = 0.0, predicted = 0.0;
    int margin_moves = 0, sample = 0;
    long long level = 0;
    if (r == 0 && (judged = PyDict_GetItemWithError(judged_d, request_id)) == NULL && PyErr_Occurred())
        r = -1;
    if (r == 0 && (dispatched = PyDict_GetItemWithError(predicted_d, request_id)) == NULL && PyErr_Occurred())
        r = -1;
    if (r == 0 && (judged != NULL || dispatched != NULL))
        r = verdict_attr_double(guard, attr_place(guard, dl_quantile_name), dl_quantile_name, &quantile);
    int timely = 0 < ttft && ttft <= dl_k.max_latency_ms;
    if (r == 0 && judged != NULL) {
        if (!PyTuple_CheckExact(judged) || PyTuple_GET_SIZE(judged) != 2 || verdict_double(PyTuple_GET_ITEM(judged, 0), &judged_slo)
            || verdict_double(PyTuple_GET_ITEM(judged, 1), &judged_at))
            r = 1;
        else if (timed && timely && (now - judged_at) * 1000.0 <= 2.0 * judged_slo) {
            margin_moves = 1;
            r = verdict_attr_double(guard, attr_place(guard, dl_log_margin_name), dl_log_margin_name, &log_margin);
        }
    }
    double scale = 1.0, tail = 1.0;
    if (r == 0 && dispatched != NULL) {
        if (!PyTuple_CheckExact(dispatched) || PyTuple_GET_SIZE(dispatched) != 2
            || verdict_double(PyTuple_GET_ITEM(dispatched, 0), &predicted) || dl_long_arg(PyTuple_GET_ITEM(dispatched, 1), &level))
            r = 1;
        else if (predicted >= dl_k.min_sample_ms && timely) {
            sample = 1;
            levels = attr_get(guard, dl_levels_name);
            samples = levels == NULL ? NULL : attr_get(guard, dl_samples_name);
            scales = samples == NULL ? NULL : attr_get(guard, dl_scales_name);
            tails = scales == NULL ? NULL : attr_get(guard, dl_tails_name);
            long long count;
            if (tails == NULL)
                r = -1;
            else if (!PyList_CheckExact(levels) || !PyList_CheckExact(samples) || !PyList_CheckExact(scales)
                     || !PyList_CheckExact(tails) || PyList_GET_SIZE(levels) != dl_k.load_levels
                     || PyList_GET_SIZE(samples) != dl_k.load_levels || PyList_GET_SIZE(scales) != dl_k.load_levels
                     || PyList_GET_SIZE(tails) != dl_k.load_levels || level < 0 || level >= dl_k.load_levels)
                r = 1;
            else {
                PyObject *pair = PyList_GET_ITEM(levels, level);
                r = !PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2
                    || verdict_double(PyTuple_GET_ITEM(pair, 0), &scale) || verdict_double(PyTuple_GET_ITEM(pair, 1), &tail)
                    || !(scale > 0.0) || !(tail > 0.0);
                for (Py_ssize_t at = 0; r == 0 && at < dl_k.load_levels; at++) /* _relevel reads their truth */
                    r = dl_long_arg(PyList_GET_ITEM(samples, at), &count) || count == LLONG_MAX;
            }
        }
    }
    double hold_ms = 0.0, hold_sq = 0.0;
    int holds = 0 < ttft && ttft + 1.0 <= e2e && e2e <= dl_k.max_latency_ms; /* a decode of 1 ms or more */
    if (r == 0 && holds && (r = verdict_attr_double(guard, attr_place(guard, dl_hold_ms_name), dl_hold_ms_name, &hold_ms)) == 0)
        r = verdict_attr_double(guard, attr_place(guard, dl_hold_sq_name), dl_hold_sq_name, &hold_sq);
    /* checked: now the writes, in the reference's order */
    if (r == 0 && wid != NULL) {
        Py_INCREF(wid);
        Py_XINCREF(flight);
        if (PyDict_DelItem(where, request_id) < 0)
            r = -1;
        else if (flight != NULL && PyDict_GetItemWithError(flight, request_id) != NULL && PyObject_DelItem(flight, request_id) < 0)
            r = -1;
        else if (PyErr_Occurred())
            r = -1;
        Py_DECREF(wid);
        Py_XDECREF(flight);
    }
    if (r == 0 && judged != NULL) {
        if (PyObject_DelItem(judged_d, request_id) < 0)
            r = -1;
        else if (margin_moves) {
            double missed = ttft > judged_slo ? 1.0 : 0.0;
            log_margin = verdict_min(verdict_max(log_margin + dl_k.margin_step * (missed - (1.0 - quantile)), 0.0),
                                     dl_k.log_scale_range);
            if (dl_set_double(guard, dl_log_margin_name, log_margin) < 0 || dl_set_double(guard, dl_margin_name, exp(log_margin)) < 0)
                r = -1;
        }
    }
    if (r == 0 && dispatched != NULL) {
        if (PyObject_DelItem(predicted_d, request_id) < 0)
            r = -1;
        else if (sample) {
            long long count;
            exact_long(PyList_GET_ITEM(samples, level), &count);
            double log_ratio = dl_clamp(log(ttft) - log(predicted), dl_k.log_scale_range);
            double log_scale = log(scale) + dl_k.scale_weight * (log_ratio - log(scale));
            double log_tail = log(tail);
            log_tail += dl_k.tail_step * (quantile - (log_ratio <= log_tail ? 1.0 : 0.0));
            PyObject *new_scale = PyFloat_FromDouble(exp(dl_clamp(log_scale, dl_k.log_scale_range)));
            PyObject *new_tail = PyFloat_FromDouble(exp(dl_clamp(log_tail, dl_k.log_scale_range)));
            PyObject *corrected = new_scale == NULL || new_tail == NULL ? NULL : PyTuple_Pack(2, new_scale, new_tail);
            PyObject *relevelled = corrected == NULL ? NULL : PyList_GetSlice(levels, 0, dl_k.load_levels);
            PyObject *counted = relevelled == NULL ? NULL : PyLong_FromLongLong(count + 1);
            if (counted == NULL)
                r = -1;
            else { /* in range, checked above: the three cannot fail */
                PyList_SetItem(samples, level, counted);
                PyList_SetItem(scales, level, Py_NewRef(new_scale));
                PyList_SetItem(tails, level, Py_NewRef(new_tail));
            }
            /* _relevel: the levels that read this one (itself and the unsampled ones above it) */
            for (long long at = level; r == 0 && at < dl_k.load_levels; at++) {
                long long seen;
                exact_long(PyList_GET_ITEM(samples, at), &seen);
                if (at > level && seen)
                    break;
                PyList_SetItem(relevelled, at, Py_NewRef(corrected));
            }
            if (r == 0 && attr_set(guard, dl_levels_name, relevelled) < 0)
                r = -1;
            Py_XDECREF(new_scale);
            Py_XDECREF(new_tail);
            Py_XDECREF(corrected);
            Py_XDECREF(relevelled);
        }
    }
    if (r == 0 && holds) {
        double held = e2e - ttft;
        if (!hold_ms) {
            hold_ms = held;
            hold_sq = held * held;
        }
        else {
            hold_ms += dl_k.hold_weight * (held - hold_ms);
            hold_sq += dl_k.hold_weight * (held * held - hold_sq);
        }
        if (dl_set_double(guard, dl_hold_ms_name, hold_ms) < 0 || dl_set_double(guard, dl_hold_sq_name, hold_sq) < 0)
            r = -1;
    }
    Py_XDECREF(where);
    Py_XDECREF(flight_d);
    Py_XDECREF(judged_d);
    Py_XDECREF(predicted_d);
    Py_XDECREF(levels);
    Py_XDECREF(samples);
    Py_XDECREF(scales);
    Py_XDECREF(tails);
    if (r != 0) {
        if (r < 0)
            return NULL;
        Py_RETURN_NOTIMPLEMENTED;
    }
    Py_RETURN_NONE;
}

/* named_among(candidates, wanted) -> (named, mask) | NotImplemented
 *
 * The candidates (in order) whose id is in the set `wanted`, and their routing mask (bit `slot`
 * of each); the reference is index/workers.py: named_among_py. A Route naming many candidate
 * workers (a gateway's endpoint subset; deadline admission's reroute among the ~900 of 1,024
 * workers that meet the SLO) is narrowed to them by this pass: as a list comprehension and an
 * or of 1,024-bit ints it was ~100 us of each such Route at 1,024 workers. NotImplemented (the
 * caller runs the reference) for a `wanted` that is not a set or frozenset, an id that is not a
 * str, or a slot that is not an int in [0, 2**24). */
#define NAMED_MAX_SLOT (1 << 24)

static PyObject *
named_among(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "named_among(candidates, wanted) takes 2 arguments");
        return NULL;
    }
    PyObject *wanted = args[1];
    if (!PyAnySet_CheckExact(wanted))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *seq = PySequence_Fast(args[0], "candidates must be a sequence");
    if (seq == NULL)
        return NULL;
    PyObject *named = PyList_New(0);
    unsigned char *bits = NULL;
    size_t width = 0; /* bytes of `bits` */
    PyTypeObject *known = NULL;
    Py_ssize_t id_at = -1, slot_at = -1;
    int declined = 0;
    if (named == NULL)
        goto error;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *item = Py_NewRef(PySequence_Fast_ITEMS(seq)[i]); /* a getter may drop the list's */
        if (Py_TYPE(item) != known) {
            known = Py_TYPE(item);
            id_at = member_offset(known, id_name);
            slot_at = member_offset(known, slot_name);
        }
        PyObject *id = member_get(item, id_at, id_name);
        if (id == NULL) {
            Py_DECREF(item);
            goto error;
        }
        if (!PyUnicode_CheckExact(id)) { /* its __hash__/__eq__ could be anything */
            Py_DECREF(id);
            Py_DECREF(item);
            declined = 1;
            break;
        }
        int in = PySet_Contains(wanted, id);
        Py_DECREF(id);
        if (in <= 0) {
            Py_DECREF(item);
            if (in < 0)
                goto error;
            continue;
        }
        PyObject *slot = member_get(item, slot_at, slot_name);
        long long s;
        if (slot == NULL) {
            Py_DECREF(item);
            goto error;
        }
        if (!PyLong_CheckExact(slot) || exact_long(slot, &s) || s < 0 || s >= NAMED_MAX_SLOT) {
            Py_DECREF(slot);
            Py_DECREF(item);
            declined = 1;
            break;
        }
        Py_DECREF(slot);
        if ((size_t)(s >> 3) >= width) {
            size_t grown = width ? width : 64;
            while (grown <= (size_t)(s >> 3))
                grown *= 2;
            unsigned char *more = PyMem_Realloc(bits, grown);
            if (more == NULL) {
                Py_DECREF(item);
                PyErr_NoMemory();
                goto error;
            }
            memset(more + width, 0, grown - width);
            bits = more;
            width = grown;
        }
        bits[s >> 3] |= (unsigned char)(1u << (s & 7));
        int appended = PyList_Append(named, item);
        Py_DECREF(item);
        if (appended < 0)
            goto error;
    }
    Py_DECREF(seq);
    if (declined) {
        PyMem_Free(bits);
        Py_DECREF(named);
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *mask = width ? _PyLong_FromByteArray(bits, width, 1, 0) : PyLong_FromLong(0);
    PyMem_Free(bits);
    if (mask == NULL) {
        Py_DECREF(named);
        return NULL;
    }
    return Py_BuildValue("(NN)", named, mask);
error:
    Py_DECREF(seq);
    Py_XDECREF(named);
    PyMem_Free(bits);
    return NULL;
}

/* min_ttft_pick(candidates, slots, overlaps, claimed, prompt_tokens, block_size, now, backlog, rate, cost)
 *     -> (i, ttft_ms, pending_tokens) | NotImplemented
 *
 * min_ttft's choice (policies/routing/min_ttft.py, DualMap Eq. 7): the candidate with the lowest
 * estimated TTFT, ties to fewer pending prefill tokens, then the lowest slot, the first of
 * equals; its TTFT and pending tokens. The reference is the policy's explained pass, which
 * prices every candidate through policies/latency.py (LatencyModel.pending_tokens, ttft_ms,
 * PrefillCost.ms), and the tests hold the two to identical answers. That pass is ~2 us a
 * worker, ~2 ms a Route at 1,024 workers; here the pending tokens and in-flight requests are
 * read by slot from the registry's loads through the candidates' CandidateSlots, and a Worker's
 * id only where its backlog drains.
 *
 * backlog: LatencyModel's drained backlog (id -> (tokens, as of time)), None where the pending
 * model counts the tokens in flight as they are; rate: its prefill tokens a second; cost:
 * (linear, ms_per_1k, intercept_ms, a_ms, b, c, pair_ms, chunk), PrefillCost's coefficients,
 * chunk 0 when the attention term is off (LatencyModel.pricing_inputs). The arithmetic is the
 * reference's, operation for operation (the extension builds with -ffp-contract=off, so no
 * multiply-add fuses its rounding). NotImplemented where a value read is not what the books keep
 * or a count leaves the range where C's arithmetic is Python's (2^53 tokens, 2^31 uncached). */
#define TTFT_EXACT_TOKENS (1LL << 53)

typedef struct {
    int linear;
    double ms_per_1k, intercept_ms, a_ms, b, c, pair_ms;
    long long chunk;
} TtftCost;

/* a coefficient, an exact float: 0, or 1 (NotImplemented). An int coefficient (a LatencyParams
 * built in code; the config's are floats) makes Python's int arithmetic exact where C's would
 * round, so such a cost is left to the reference */
static inline int
ttft_float(PyObject *v, double *out)
{
    if (!PyFloat_CheckExact(v))
        return 1;
    *out = PyFloat_AS_DOUBLE(v);
    return 0;
}

/* PrefillCost.ms(tokens, batch, attended) */
static inline double
ttft_cost_ms(const TtftCost *cost, long long tokens, long long batch, long long attended)
{
    if (tokens <= 0)
        return 0.0;
    double base;
    if (cost->linear) {
        base = cost->intercept_ms + cost->ms_per_1k * (double)tokens / 1000.0;
    } else {
        if (batch < 1)
            batch = 1;
        base = cost->a_ms * pow((double)batch, cost->b) * pow((double)tokens / (double)batch, cost->c);
    }
    return attended > 0 ? base + cost->pair_ms * (double)attended : base;
}

/* attended_pairs(new_tokens, 0, chunk): the pairs a prompt's chunks attend to before their own */
static inline long long
ttft_attended(long long new_tokens, long long chunk)
{
    if (new_tokens <= 0 || chunk <= 0)
        return 0;
    long long full = new_tokens / chunk, rest = new_tokens % chunk;
    return chunk * chunk * full * (full - 1) / 2 + rest * full * chunk;
}

/* LatencyModel._pending: the committed tokens left after the backlog drained at `rate` since it
 * was last set: 0, 1 (NotImplemented), -1 on error */
static int
ttft_pending(PyObject *backlog, PyObject *item, Py_ssize_t id_at, double now, double rate, long long committed,
             long long *out)
{
    *out = committed;
    if (backlog == Py_None || committed <= 0)
        return 0;
    if (committed >= TTFT_EXACT_TOKENS) /* compared with a double below */
        return 1;
    Py_INCREF(item); /* a getter run on it may drop the list's reference */
    PyObject *id = member_get(item, id_at, id_name);
    Py_DECREF(item);
    if (id == NULL)
        return -1;
    PyObject *kept = PyDict_GetItemWithError(backlog, id); /* borrowed */
    Py_DECREF(id);
    double tokens = 0.0, at = now;
    if (kept == NULL) {
        if (PyErr_Occurred())
            return -1;
    } else if (!PyTuple_CheckExact(kept) || PyTuple_GET_SIZE(kept) != 2
               || verdict_double(PyTuple_GET_ITEM(kept, 0), &tokens) || verdict_double(PyTuple_GET_ITEM(kept, 1), &at)) {
        return 1;
    }
    double left = tokens - rate * verdict_max(0.0, now - at);
    if (!isfinite(left)) /* round() raises there: the reference says how */
        return 1;
    double rounded = nearbyint(left); /* round(): to nearest, ties to even, as the default mode */
    *out = rounded <= 0.0 ? 0 : (rounded >= (double)committed ? committed : (long long)rounded);
    return 0;
}

/* What min_ttft_pick, preble_pick and dualmap_cold_pick read alike: the first ten arguments,
 * parsed once */
typedef struct {
    PyObject *seq, *overlaps, *claimed, *backlog;
    OverlapsObject *by_slot;
    Py_ssize_t claim_count, n, id_at;
    long long prompt_tokens, block_size;
    double now, rate;
    TtftCost cost;
    const CandidateSlotsObject *c;
    CandidateLoads loads;
    long long attended_for, attended; /* the attention pairs of the last uncached count read */
    long long idle_for;               /* ... and the idle TTFT (the request's own prefill) of the */
    double idle_ms;                   /* last uncached count priced idle */
} TtftPass;

/* parse (candidates, slots, overlaps, claimed, prompt_tokens, block_size, now, backlog, rate,
 * cost): 0 (p->seq a new reference), 1 (NotImplemented), -1 on error */
static int
ttft_pass_init(TtftPass *p, PyObject *const *args)
{
    PyObject *cost_args = args[9];
    long long chunk = 0;
    p->seq = NULL;
    p->overlaps = args[2];
    p->claimed = args[3];
    p->backlog = args[7];
    p->attended_for = p->idle_for = -1;
    p->attended = 0;
    p->idle_ms = 0.0;
    p->prompt_tokens = 0; /* read by preble_pick even where this declines */
    p->claim_count = PyObject_Length(p->claimed); /* ctx.claimed: a dict, or the empty MappingProxyType */
    if (p->claim_count < 0)
        return -1;
    if (!Py_IS_TYPE(args[1], &CandidateSlotsType) || scan_overlaps(p->overlaps, &p->by_slot)
        || (p->claim_count && !PyDict_Check(p->claimed)) || !PyLong_CheckExact(args[4])
        || exact_long(args[4], &p->prompt_tokens) || !PyLong_CheckExact(args[5]) || exact_long(args[5], &p->block_size)
        || verdict_double(args[6], &p->now) || (p->backlog != Py_None && !PyDict_CheckExact(p->backlog))
        || verdict_double(args[8], &p->rate) || !PyTuple_CheckExact(cost_args) || PyTuple_GET_SIZE(cost_args) != 8
        || !PyBool_Check(PyTuple_GET_ITEM(cost_args, 0)) || ttft_float(PyTuple_GET_ITEM(cost_args, 1), &p->cost.ms_per_1k)
        || ttft_float(PyTuple_GET_ITEM(cost_args, 2), &p->cost.intercept_ms)
        || ttft_float(PyTuple_GET_ITEM(cost_args, 3), &p->cost.a_ms) || ttft_float(PyTuple_GET_ITEM(cost_args, 4), &p->cost.b)
        || ttft_float(PyTuple_GET_ITEM(cost_args, 5), &p->cost.c)
        || ttft_float(PyTuple_GET_ITEM(cost_args, 6), &p->cost.pair_ms) || !PyLong_CheckExact(PyTuple_GET_ITEM(cost_args, 7))
        || exact_long(PyTuple_GET_ITEM(cost_args, 7), &chunk) || p->prompt_tokens < 0 || p->prompt_tokens >= TTFT_EXACT_TOKENS
        || p->block_size < 0 || p->block_size >= (1LL << 31))
        return 1;
    p->cost.linear = PyTuple_GET_ITEM(cost_args, 0) == Py_True;
    p->cost.chunk = chunk;
    p->c = (const CandidateSlotsObject *)args[1];
    p->seq = PySequence_Fast(args[0], "candidates must be a sequence");
    if (p->seq == NULL)
        return -1;
    p->n = PySequence_Fast_GET_SIZE(p->seq);
    if (candidate_loads(p->c, p->n, &p->loads))
        return 1;
    p->id_at = member_offset(p->c->cls, id_name);
    return 0;
}

/* The prefix `slot` holds (RoutingContext.overlap): from the walk's Overlaps (`by_slot`), or
 * looked up in a dict of them: 0, 1 (NotImplemented: not an int of 64 bits), -1 on error */
static int
slot_depth(PyObject *overlaps, OverlapsObject *by_slot, uint32_t slot, long long *depth)
{
    *depth = 0;
    if (by_slot != NULL) {
        *depth = overlaps_depth(by_slot, slot);
        return 0;
    }
    if (!PyDict_GET_SIZE(overlaps))
        return 0;
    PyObject *key = PyLong_FromUnsignedLong(slot);
    if (key == NULL)
        return -1;
    int r = scan_depth(overlaps, NULL, key, depth);
    Py_DECREF(key);
    return r;
}

/* candidate i's prefix held (RoutingContext.overlap), uncached prompt tokens
 * (RoutingContext.uncached_tokens), pending prefill tokens (LatencyModel.pending_tokens),
 * in-flight requests, and the attention pairs of its uncached tokens (p->attended): 0, 1
 * (NotImplemented), -1 on error */
static int
ttft_pass_read(TtftPass *p, Py_ssize_t i, long long *overlap_out, long long *uncached_out, long long *pending_out,
               long long *inflight_out)
{
    if (i >= PySequence_Fast_GET_SIZE(p->seq)) /* Python code the pass ran shrank the list */
        return 1;
    PyObject *item = PySequence_Fast_ITEMS(p->seq)[i];
    if (Py_TYPE(item) != p->c->cls)
        return 1;
    uint32_t slot = p->c->slots[i];
    long long overlap;
    int r = slot_depth(p->overlaps, p->by_slot, slot, &overlap);
    if (r != 0)
        return r;
    if (overlap < -(1LL << 31) || overlap > (1LL << 31)) /* before a claim is taken from it */
        return 1;
    long long cached = overlap;
    if (p->claim_count) {
        PyObject *key = PyLong_FromUnsignedLong(slot);
        if (key == NULL)
            return -1;
        long long held_back;
        r = verdict_dict_long(p->claimed, key, 0, &held_back);
        Py_DECREF(key);
        if (r != 0)
            return r;
        if (held_back < -(1LL << 31) || held_back > (1LL << 31))
            return 1;
        cached -= held_back;
    }
    if (cached < -(1LL << 31) || cached > (1LL << 31))
        return 1;
    long long uncached = p->prompt_tokens - cached * p->block_size;
    if (uncached < 0)
        uncached = 0;
    if (uncached >= (1LL << 31))
        return 1;
    const CandidateLoads *loads = &p->loads;
    long long committed = slot < loads->capacity ? loads->pendings[slot] : 0;
    long long inflight = slot < loads->capacity ? loads->inflights[slot] : 0;
    long long pending;
    r = ttft_pending(p->backlog, item, p->id_at, p->now, p->rate, committed, &pending);
    if (r != 0)
        return r;
    if (pending >= TTFT_EXACT_TOKENS - uncached || inflight >= TTFT_EXACT_TOKENS || pending <= -TTFT_EXACT_TOKENS
        || inflight <= -TTFT_EXACT_TOKENS)
        return 1;
    if (uncached != p->attended_for) { /* most candidates share an overlap: none, or a system prompt */
        p->attended_for = uncached;
        p->attended = ttft_attended(uncached, p->cost.chunk);
    }
    *overlap_out = overlap;
    *uncached_out = uncached;
    *pending_out = pending;
    *inflight_out = inflight;
    return 0;
}

/* LatencyModel.ttft_ms(uncached, tokens_ahead, requests_ahead) of the candidate ttft_pass_read
 * read last (its attention pairs): with nothing ahead, the request's own prefill, priced once
 * per uncached count (most candidates share one: none of the prompt held, or a system prompt) */
static inline double
ttft_pass_ms(TtftPass *p, long long uncached, long long tokens_ahead, long long requests_ahead)
{
    if (tokens_ahead == 0 && requests_ahead <= 0) {
        if (uncached != p->idle_for) {
            p->idle_for = uncached;
            p->idle_ms = ttft_cost_ms(&p->cost, uncached, 1, p->attended);
        }
        return p->idle_ms;
    }
    return ttft_cost_ms(&p->cost, tokens_ahead + uncached, (requests_ahead > 0 ? requests_ahead : 0) + 1, p->attended);
}

/* ends a pass: its result, or NotImplemented (r 1), or NULL (r -1) */
static PyObject *
ttft_pass_end(TtftPass *p, int r, PyObject *result)
{
    Py_XDECREF(p->seq);
    if (r < 0) {
        Py_XDECREF(result);
        return NULL;
    }
    if (r > 0) {
        Py_XDECREF(result);
        Py_RETURN_NOTIMPLEMENTED;
    }
    return result;
}

static PyObject *
min_ttft_pick(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "min_ttft_pick(candidates, slots, overlaps, claimed, prompt_tokens, block_size, now, backlog, "
                        "rate, cost) takes 10 arguments");
        return NULL;
    }
    TtftPass p;
    int r = ttft_pass_init(&p, args);
    Py_ssize_t best_i = -1;
    double best_ttft = 0.0;
    long long best_pending = 0;
    uint32_t best_slot = 0;
    for (Py_ssize_t i = 0; r == 0 && i < p.n; i++) {
        long long overlap, uncached, pending, inflight;
        if ((r = ttft_pass_read(&p, i, &overlap, &uncached, &pending, &inflight)) != 0)
            break;
        double ttft = ttft_pass_ms(&p, uncached, pending, inflight);
        uint32_t slot = p.c->slots[i];
        /* min() of (ttft, pending, slot): the first element that differs decides, NaN never less */
        int better;
        if (best_i < 0)
            better = 1;
        else if (ttft != best_ttft)
            better = ttft < best_ttft;
        else if (pending != best_pending)
            better = pending < best_pending;
        else
            better = slot < best_slot;
        if (better) {
            best_i = i;
            best_ttft = ttft;
            best_pending = pending;
            best_slot = slot;
        }
    }
    return ttft_pass_end(&p, r, r == 0 ? Py_BuildValue("(ndL)", best_i, best_ttft, best_pending) : NULL);
}

/* preble_pick(candidates, slots, overlaps, claimed, prompt_tokens, block_size, now, backlog, rate, cost,
 *             hit_threshold) -> (i, load_cost_ms, best_hit, prefix_hit) | NotImplemented
 *
 * Preble's rule (policies/routing/preble.py, DualMap sections 2.2 and B): each candidate's
 * prefix hit rate min(1, cached tokens / prompt tokens) and load cost, its TTFT as min_ttft
 * prices it; above hit_threshold the best hit wins (ties to the lower cost, then slot),
 * otherwise the lowest cost (ties to the slot), the first of equals. The first ten arguments are
 * min_ttft_pick's. The reference is the policy's explained pass, which prices every candidate
 * in Python; the tests hold the two to the same worker, cost and hit rate. */
typedef struct {
    Py_ssize_t i;
    double cost;
    uint32_t slot;
} PrebleRow;

/* whether (cost, slot) of a comes before b's in min(): the first element that differs decides */
static inline int
preble_before(const PrebleRow *a, const PrebleRow *b)
{
    return b->i < 0 || (a->cost != b->cost ? a->cost < b->cost : a->slot < b->slot);
}

static PyObject *
preble_pick(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError,
                        "preble_pick(candidates, slots, overlaps, claimed, prompt_tokens, block_size, now, backlog, "
                        "rate, cost, hit_threshold) takes 11 arguments");
        return NULL;
    }
    double threshold;
    if (verdict_double(args[10], &threshold))
        Py_RETURN_NOTIMPLEMENTED;
    TtftPass p;
    int r = ttft_pass_init(&p, args);
    PrebleRow by_cost = {-1, 0.0, 0}, by_hit = {-1, 0.0, 0};
    double best_hit = 0.0;
    long long prompt = p.prompt_tokens > 1 ? p.prompt_tokens : 1;
    for (Py_ssize_t i = 0; r == 0 && i < p.n; i++) {
        long long held, uncached, pending, inflight;
        if ((r = ttft_pass_read(&p, i, &held, &uncached, &pending, &inflight)) != 0)
            break;
        uint32_t slot = p.c->slots[i];
        /* overlap * block_size / prompt, as Python divides two ints: exact below 2^53 */
        if (held < 0 || held >= (1LL << 31) || held * p.block_size >= TTFT_EXACT_TOKENS) {
            r = 1;
            break;
        }
        double hit = (double)(held * p.block_size) / (double)prompt;
        if (!(hit < 1.0))
            hit = 1.0;
        PrebleRow row = {i, ttft_pass_ms(&p, uncached, pending, inflight), slot};
        if (preble_before(&row, &by_cost))
            by_cost = row;
        if (by_hit.i < 0 || hit > best_hit) {
            best_hit = hit;
            by_hit = row;
        } else if (hit == best_hit && preble_before(&row, &by_hit)) {
            by_hit = row;
        }
    }
    int prefix_hit = best_hit > threshold;
    const PrebleRow *chosen = prefix_hit ? &by_hit : &by_cost;
    return ttft_pass_end(&p, r, r == 0 ? Py_BuildValue("(nddO)", chosen->i, chosen->cost, best_hit,
                                                       prefix_hit ? Py_True : Py_False) : NULL);
}

/* dualmap_cold_pick(candidates, slots, overlaps, claimed, prompt_tokens, block_size, now, backlog, rate, cost,
 *                   slo_ms, threshold, stall) -> (first, second) | NotImplemented
 *
 * DualMap's fleet-wide (cold) placement (policies/routing/dualmap.py, section 3.2's cold start):
 * the indices of the best two candidates in _cold_order, not overloaded, then the lowest TTFT,
 * the least load, the lowest slot (second -1 for one candidate). The reference is the policy's
 * explained placement, which builds every candidate's _View (DualMapPolicy._view) and sorts
 * them; the tests hold the two to the same workers. Each view priced in Python was ~2 us, a
 * cold Route ~2.2 ms at 1,024 workers. The first ten arguments are min_ttft_pick's; slo_ms the
 * Route's SLO; threshold the static threshold's tokens, or -1 where the SLO test prices the TTFT
 * (slo_test "ttft"); stall: A.7's interval for a worker (DualMapPolicy.bottleneck_ms), called
 * only where it can be non-zero (requests in flight and a queue waiting: the engine's reported
 * or the router's), or None where A.7 is off. */
static PyObject *queued_prefill_tokens_name, *queued_requests_name; /* interned */

/* (overloaded, ttft, load, slot) of a view, as _cold_order compares them */
typedef struct {
    Py_ssize_t i;
    int overloaded;
    double ttft;
    long long load;
    uint32_t slot;
} ColdView;

/* whether view a comes before view b in _cold_order (tuples: the first element that differs decides) */
static inline int
cold_before(const ColdView *a, const ColdView *b)
{
    if (a->overloaded != b->overloaded)
        return a->overloaded < b->overloaded;
    if (a->ttft != b->ttft)
        return a->ttft < b->ttft;
    if (a->load != b->load)
        return a->load < b->load;
    return a->slot < b->slot;
}

static PyObject *
dualmap_cold_pick(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError,
                        "dualmap_cold_pick(candidates, slots, overlaps, claimed, prompt_tokens, block_size, now, backlog, "
                        "rate, cost, slo_ms, threshold, stall) takes 13 arguments");
        return NULL;
    }
    double slo_ms;
    long long threshold;
    PyObject *stall = args[12];
    if (verdict_double(args[10], &slo_ms) || !PyLong_CheckExact(args[11]) || exact_long(args[11], &threshold)
        || (stall != Py_None && !PyCallable_Check(stall)))
        Py_RETURN_NOTIMPLEMENTED;
    TtftPass p;
    int r = ttft_pass_init(&p, args);
    Py_ssize_t queued_tokens_at = -1, queued_requests_at = -1, queue_at = -1;
    if (r == 0) {
        queued_tokens_at = member_offset(p.c->cls, queued_prefill_tokens_name);
        queued_requests_at = member_offset(p.c->cls, queued_requests_name);
        queue_at = member_offset(p.c->cls, reported_queue_name);
    }
    /* a load read through a getter (not a slot member) is Python code, as the stall callback is */
    int getters = queued_tokens_at < 0 || queued_requests_at < 0 || queue_at < 0;
    ColdView best = {-1, 0, 0.0, 0, 0}, second = {-1, 0, 0.0, 0, 0};
    for (Py_ssize_t i = 0; r == 0 && i < p.n; i++) {
        long long overlap, uncached, pending, inflight, queued_tokens, queued_requests, queue = 0;
        if ((r = ttft_pass_read(&p, i, &overlap, &uncached, &pending, &inflight)) != 0)
            break;
        PyObject *item = Py_NewRef(PySequence_Fast_ITEMS(p.seq)[i]); /* the stall callback may drop the list's */
        r = verdict_attr_long(item, queued_tokens_at, queued_prefill_tokens_name, &queued_tokens);
        if (r == 0)
            r = verdict_attr_long(item, queued_requests_at, queued_requests_name, &queued_requests);
        if (r == 0 && stall != Py_None && inflight > 0 && queued_requests <= 0)
            r = verdict_attr_long(item, queue_at, reported_queue_name, &queue);
        if (r == 0 && (queued_tokens < 0 || queued_tokens >= TTFT_EXACT_TOKENS - pending - uncached || queued_requests < 0
                       || queued_requests >= TTFT_EXACT_TOKENS - inflight))
            r = 1;
        double stall_ms = 0.0;
        int getters_ran = getters;
        /* DecodeBottleneck.stall_ms is 0 without requests in flight and a queue waiting */
        if (r == 0 && stall != Py_None && inflight > 0 && (queue > 0 || queued_requests > 0)) {
            PyObject *ms = PyObject_CallFunctionObjArgs(stall, item, args[6], NULL);
            r = ms == NULL ? -1 : !PyFloat_CheckExact(ms);
            if (r == 0)
                stall_ms = PyFloat_AS_DOUBLE(ms);
            Py_XDECREF(ms);
            getters_ran = 1;
        }
        if (r == 0 && getters_ran) /* Python code run on the worker may have grown (moved) the loads' array */
            r = candidate_loads(p.c, p.n, &p.loads);
        Py_DECREF(item);
        if (r != 0)
            break;
        long long load = pending + queued_tokens, requests = inflight + queued_requests;
        double ttft = ttft_pass_ms(&p, uncached, load, requests) + stall_ms;
        if (isnan(ttft)) { /* no order: the reference's sort says where it goes */
            r = 1;
            break;
        }
        int over = threshold >= 0 ? load + uncached > threshold : ttft - stall_ms > slo_ms;
        ColdView view = {i, over || stall_ms > 0, ttft, load, p.c->slots[i]};
        if (best.i < 0 || cold_before(&view, &best)) {
            second = best;
            best = view;
        } else if (second.i < 0 || cold_before(&view, &second)) {
            second = view;
        }
    }
    return ttft_pass_end(&p, r, r == 0 ? Py_BuildValue("(nn)", best.i, second.i) : NULL);
}

/* lbgr_pick(candidates, slots, overlaps, prompt_tokens, block_size, loads, factor, per_hit, per_miss,
 *           load_unit_ms, features, learners, fleet_theta, low, high) -> (i, estimate_ms) | NotImplemented
 *
 * LBGR's choice (policies/routing/lbgr.py, section 4.2, Eq. 4-6): the candidate with the lowest
 * estimate E_i = Cost_i + P_i + theta_i . phi_i, ties to the lower slot, the first of equals.
 * The reference is the policy's explained pass (LBGRPolicy.estimates, then min()), and the tests
 * hold the two to the same worker and estimate to the bit. That pass is ~1.5 us a worker, ~1.6
 * ms a Route at 1,024 workers. loads: P_i by worker id (ms, before decay), factor: the decay
 * since; per_hit, per_miss: Cost's ms per cached and uncached token; load_unit_ms: the load
 * feature's unit; features: the indices of (hit, miss, load, bias) the residual reads;
 * learners: the residual models by worker id (a model's `theta`), or None where there is one for
 * the fleet (fleet_theta, None before its first sample) or none at all; low, high: the residual's
 * range. NotImplemented where C's arithmetic could differ from the reference's: a value not a
 * float where the books keep floats, a prompt past 2^53 tokens, and on Python 3.12 and later,
 * whose sum() compensates its rounding, a residual of more than one feature. */
static PyObject *theta_name; /* interned "theta" */

/* theta . phi as the reference's sum() adds it (Python 3.11: left to right from 0), clipped to
 * [low, high] as _clip does (NaN to low): 0, or 1 (NotImplemented) */
static inline int
lbgr_residual(PyObject *theta, const double *phi, Py_ssize_t n, double low, double high, double *out)
{
    if (!PyList_CheckExact(theta))
        return 1;
    Py_ssize_t m = PyList_GET_SIZE(theta) < n ? PyList_GET_SIZE(theta) : n;
#if PY_VERSION_HEX >= 0x030C0000
    if (m > 1)
        return 1;
#endif
    double sum = 0.0;
    for (Py_ssize_t k = 0; k < m; k++) {
        PyObject *t = PyList_GET_ITEM(theta, k);
        if (!PyFloat_CheckExact(t))
            return 1;
        sum += PyFloat_AS_DOUBLE(t) * phi[k];
    }
    *out = low <= sum && sum <= high ? sum : (sum > high ? high : low);
    return 0;
}

static PyObject *
lbgr_pick(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 15) {
        PyErr_SetString(PyExc_TypeError,
                        "lbgr_pick(candidates, slots, overlaps, prompt_tokens, block_size, loads, factor, per_hit, "
                        "per_miss, load_unit_ms, features, learners, fleet_theta, low, high) takes 15 arguments");
        return NULL;
    }
    PyObject *overlaps = args[2], *loads = args[5], *features = args[10], *learners = args[11], *fleet_theta = args[12];
    OverlapsObject *by_slot;
    long long prompt_tokens, block_size;
    double factor, per_hit, per_miss, unit, low, high;
    if (!Py_IS_TYPE(args[1], &CandidateSlotsType) || scan_overlaps(overlaps, &by_slot) || !PyLong_CheckExact(args[3])
        || exact_long(args[3], &prompt_tokens) || !PyLong_CheckExact(args[4]) || exact_long(args[4], &block_size)
        || !PyDict_CheckExact(loads) || ttft_float(args[6], &factor) || ttft_float(args[7], &per_hit)
        || ttft_float(args[8], &per_miss) || ttft_float(args[9], &unit) || !PyTuple_CheckExact(features)
        || PyTuple_GET_SIZE(features) < 1 || PyTuple_GET_SIZE(features) > 4
        || (learners != Py_None && !PyDict_CheckExact(learners)) || ttft_float(args[13], &low)
        || ttft_float(args[14], &high) || prompt_tokens < 0 || prompt_tokens >= TTFT_EXACT_TOKENS || block_size < 0
        || block_size >= (1LL << 31))
        Py_RETURN_NOTIMPLEMENTED;
    Py_ssize_t n_features = PyTuple_GET_SIZE(features);
    int feature_at[4];
    for (Py_ssize_t k = 0; k < n_features; k++) {
        long long f;
        if (!PyLong_CheckExact(PyTuple_GET_ITEM(features, k)) || exact_long(PyTuple_GET_ITEM(features, k), &f) || f < 0
            || f > 3)
            Py_RETURN_NOTIMPLEMENTED;
        feature_at[k] = (int)f;
    }
    const CandidateSlotsObject *c = (const CandidateSlotsObject *)args[1];
    PyObject *seq = PySequence_Fast(args[0], "candidates must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), best_i = -1;
    int r = n == 0 || Py_SIZE(c) != n;
    Py_ssize_t id_at = r ? -1 : member_offset(c->cls, id_name);
    double best = 0.0;
    uint32_t best_slot = 0;
    int fleet_learned = learners == Py_None && fleet_theta != Py_None;
    for (Py_ssize_t i = 0; r == 0 && i < n; i++) {
        if (i >= PySequence_Fast_GET_SIZE(seq)) { /* a theta getter shrank the list */
            r = 1;
            break;
        }
        PyObject *item = PySequence_Fast_ITEMS(seq)[i];
        if (Py_TYPE(item) != c->cls) {
            r = 1;
            break;
        }
        uint32_t slot = c->slots[i];
        long long overlap;
        if ((r = slot_depth(overlaps, by_slot, slot, &overlap)) != 0)
            break;
        if (overlap < 0 || overlap >= (1LL << 31)) {
            r = 1;
            break;
        }
        long long hit = overlap * block_size < prompt_tokens ? overlap * block_size : prompt_tokens;
        long long miss = prompt_tokens - hit;
        Py_INCREF(item); /* a getter run on it may drop the list's reference */
        PyObject *id = member_get(item, id_at, id_name);
        Py_DECREF(item);
        if (id == NULL) {
            r = -1;
            break;
        }
        double load = 0.0, residual = 0.0;
        PyObject *kept = PyDict_GetItemWithError(loads, id); /* borrowed */
        if (kept != NULL)
            r = ttft_float(kept, &load);
        else if (PyErr_Occurred())
            r = -1;
        load *= factor;
        double phi[4] = {0.0, 0.0, 0.0, 0.0};
        if (r == 0 && (learners != Py_None || fleet_learned)) {
            double values[4] = {(double)hit / 1000.0, (double)miss / 1000.0, load / unit, 1.0};
            for (Py_ssize_t k = 0; k < n_features; k++)
                phi[k] = values[feature_at[k]];
            if (fleet_learned) {
                r = lbgr_residual(fleet_theta, phi, n_features, low, high, &residual);
            } else {
                PyObject *learner = PyDict_GetItemWithError(learners, id); /* borrowed */
                if (learner != NULL) {
                    Py_INCREF(learner);
                    PyObject *theta = PyObject_GetAttr(learner, theta_name);
                    Py_DECREF(learner);
                    r = theta == NULL ? -1 : lbgr_residual(theta, phi, n_features, low, high, &residual);
                    Py_XDECREF(theta);
                } else if (PyErr_Occurred()) {
                    r = -1;
                }
            }
        }
        Py_DECREF(id);
        if (r != 0)
            break;
        double total = per_hit * (double)hit + per_miss * (double)miss + load + residual;
        /* min() of (total, slot): the first element that differs decides, NaN never less */
        if (best_i < 0 || (total != best ? total < best : slot < best_slot)) {
            best_i = i;
            best = total;
            best_slot = slot;
        }
    }
    Py_DECREF(seq);
    if (r < 0)
        return NULL;
    if (r > 0)
        Py_RETURN_NOTIMPLEMENTED;
    return Py_BuildValue("(nd)", best_i, best);
}


/* ---- the in-flight table: a routed request kept, a completed one forgotten ------------------
 *
 * ledger_constants(entry_bytes, candidate_bytes) -> None
 * ledger_keep(ledger, req) -> None | NotImplemented
 * ledger_forget(ledger, request_id) -> PackedRequest | None | NotImplemented
 *
 * router/ledger.py's LoadLedger._keep and forget_request, whose references are _keep_py and
 * _forget_py there; a test holds the two to the same tables over random requests. Every Route
 * puts its request in the table as one flat tuple (pack_request) with what it costs
 * (request_bytes), every Complete takes it out: in bytecode the pair was ~16k of the ~314k
 * instructions a streamed Route + Complete takes (callgrind, the two switched off). The tables
 * stay the ledger's own dict and ints, so everything else that reads them sees one state.
 * NotImplemented (the caller runs the reference) for what only the reference handles: keys
 * that are not an array('Q') (a list is packed key by key), a field not of its exact type (the
 * reference converts it with str(), int() or float()), tables not of theirs; decided before
 * anything is written. */
static PyObject *lg_requests_name, *lg_by_client_name, *lg_inflight_bytes_name, *lg_request_id_name, *lg_keys_name,
    *lg_prompt_tokens_name, *lg_session_id_name, *lg_task_name, *lg_ttft_slo_ms_name, *lg_output_name,
    *lg_policy_name, *lg_candidates_name, *lg_model_name, *lg_lora_name, *lg_client_name;

/* ledger.py's constants, handed over once at its import (ledger_constants) */
static struct {
    long long entry_bytes, candidate_bytes, list_key_bytes;
    int set;
} lg_k;

/* the packed request's fields (ledger.py's pack_request) before its candidate workers */
enum { LG_CLIENT = 10, LG_SIZE = 11, LG_CANDIDATES = 13 };

/* Where a class keeps the fields a pass reads (member_offset), found once per class and version
 * of it (a class changed since has another version tag): read in place, a RouteRequest's twelve
 * were ~2.5k instructions a Route through the generic lookup */
enum { LG_FIELDS = 12 };
typedef struct {
    PyTypeObject *type; /* a strong reference */
    unsigned int tag;
    Py_ssize_t at[LG_FIELDS];
} FieldOffsets;

/* `f` made current for `type`, whose fields `names[0:n]` (n <= LG_FIELDS) are read */
static inline void
field_offsets(FieldOffsets *f, PyTypeObject *type, PyObject *const *names, int n)
{
    if (type == f->type && PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG) && type->tp_version_tag == f->tag)
        return;
    for (int i = 0; i < n; i++)
        f->at[i] = member_offset(type, names[i]);
    Py_XSETREF(f->type, (PyTypeObject *)Py_NewRef(type));
    f->tag = PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG) ? type->tp_version_tag : 0;
}

static FieldOffsets lg_req;

static PyObject *
ledger_constants(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    long long entry, candidate, list_key;
    if (nargs != 3 || dl_long_arg(args[0], &entry) || dl_long_arg(args[1], &candidate) || dl_long_arg(args[2], &list_key)
        || entry < 0 || candidate < 0 || list_key < 0) {
        PyErr_SetString(PyExc_TypeError, "ledger_constants takes 3 ints >= 0 (see ledger.py)");
        return NULL;
    }
    lg_k.entry_bytes = entry;
    lg_k.candidate_bytes = candidate;
    lg_k.list_key_bytes = list_key;
    lg_k.set = 1;
    Py_RETURN_NONE;
}

/* `table`'s int under `key` plus `delta` into *out (the absent key counts 0 when `absent_ok`):
 * 0, -1 with an error, 1 when it holds no exact int there (or is absent and may not be) */
static int
lg_count_plus(PyObject *table, PyObject *key, long long delta, int absent_ok, long long *out)
{
    PyObject *count = PyDict_GetItemWithError(table, key);
    long long n = 0;
    if (count == NULL) {
        if (PyErr_Occurred())
            return -1;
        if (!absent_ok)
            return 1;
    }
    else if (dl_long_arg(count, &n))
        return 1;
    *out = n + delta;
    return 0;
}

static PyObject *
ledger_keep(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "ledger_keep takes 2 arguments (see LoadLedger._keep_py)");
        return NULL;
    }
    if (!lg_k.set)
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *ledger = args[0], *req = args[1];
    /* the request's fields in pack_request's order, the candidates last; then the tables */
    PyObject *const names[] = {lg_request_id_name, lg_keys_name, lg_prompt_tokens_name, lg_session_id_name, lg_task_name,
                               lg_ttft_slo_ms_name, lg_output_name, lg_policy_name, lg_model_name, lg_lora_name,
                               lg_client_name, lg_candidates_name, lg_requests_name, lg_by_client_name,
                               lg_inflight_bytes_name};
    enum { N = sizeof names / sizeof names[0], CANDIDATES = 11, REQUESTS = LG_FIELDS, BY_CLIENT = 13, BYTES = 14 };
    static const int strs[] = {0, 3, 7, 8, 9, 10}; /* the six ids, exact strs, each counted by its length */
    PyObject *v[N] = {NULL};
    PyObject *kept = NULL, *task = NULL, *packed = NULL, *bytes = NULL, *clients = NULL, *size_obj = NULL;
    PyObject *result = NULL;
    int r = 0;
    field_offsets(&lg_req, Py_TYPE(req), names, LG_FIELDS);
    for (int i = 0; i < N && r == 0; i++)
        if ((v[i] = i < LG_FIELDS ? member_get(req, lg_req.at[i], names[i]) : attr_get(ledger, names[i])) == NULL)
            r = -1;
    if (r == 0) {
        for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++)
            if (!PyUnicode_CheckExact(v[strs[i]]))
                r = 1;
        if (!Py_IS_TYPE(v[1], Py_TYPE(array_q_zero)) || !PyLong_CheckExact(v[2]) || !PyLong_Check(v[4])
            || !PyFloat_CheckExact(v[5]) || !PyLong_CheckExact(v[6]) || !PyTuple_CheckExact(v[CANDIDATES])
            || !PyDict_CheckExact(v[REQUESTS]) || !PyDict_CheckExact(v[BY_CLIENT]) || !PyLong_CheckExact(v[BYTES]))
            r = 1;
    }
    /* request_bytes: 8 bytes a key of an array('Q'), the strings' characters, each candidate's
     * name and tuple slot */
    Py_ssize_t n_candidates = r == 0 ? PyTuple_GET_SIZE(v[CANDIDATES]) : 0;
    long long size = lg_k.entry_bytes;
    for (Py_ssize_t i = 0; i < n_candidates && r == 0; i++) {
        PyObject *name = PyTuple_GET_ITEM(v[CANDIDATES], i);
        if (!PyUnicode_CheckExact(name))
            r = 1;
        else
            size += PyUnicode_GET_LENGTH(name) + lg_k.candidate_bytes;
    }
    if (r == 0) {
        Py_buffer view;
        if (PyObject_GetBuffer(v[1], &view, PyBUF_FORMAT) < 0)
            r = -1;
        else {
            if (view.itemsize != 8 || view.format == NULL || strcmp(view.format, "Q") != 0)
                r = 1; /* another typecode: listed, as pack_request does */
            else if ((kept = PyBytes_FromStringAndSize(view.buf, view.len)) == NULL)
                r = -1;
            else
                size += view.len;
            PyBuffer_Release(&view);
        }
    }
    if (r == 0) {
        for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++)
            size += PyUnicode_GET_LENGTH(v[strs[i]]);
        /* int(req.task): a TaskCategory is an IntEnum, kept as its int */
        if ((task = PyNumber_Long(v[4])) == NULL)
            r = -1;
    }
    long long held = 0;
    if (r == 0 && dl_long_arg(v[BYTES], &held))
        r = 1;
    int has_client = r == 0 && PyUnicode_GET_LENGTH(v[LG_CLIENT]) > 0;
    long long count = 0;
    if (has_client && (r = lg_count_plus(v[BY_CLIENT], v[LG_CLIENT], 1, 1, &count)) == 0
        && (clients = PyLong_FromLongLong(count)) == NULL)
        r = -1;
    if (r == 0 && ((size_obj = PyLong_FromLongLong(size)) == NULL || (bytes = PyLong_FromLongLong(held + size)) == NULL))
        r = -1;
    if (r == 0 && (packed = PyTuple_New(LG_CANDIDATES + n_candidates)) == NULL)
        r = -1;
    if (r == 0) {
        PyObject *fields[LG_CANDIDATES] = {v[0], kept, v[2], v[3], task, v[5], v[6], v[7], v[8], v[9], v[10], size_obj, Py_False};
        for (int i = 0; i < LG_CANDIDATES; i++)
            PyTuple_SET_ITEM(packed, i, Py_NewRef(fields[i]));
        for (Py_ssize_t i = 0; i < n_candidates; i++)
            PyTuple_SET_ITEM(packed, LG_CANDIDATES + i, Py_NewRef(PyTuple_GET_ITEM(v[CANDIDATES], i)));
        /* _keep_py's order: the table, its bytes, the client's count */
        if (PyDict_SetItem(v[REQUESTS], v[0], packed) < 0 || attr_set(ledger, lg_inflight_bytes_name, bytes) < 0
            || (has_client && PyDict_SetItem(v[BY_CLIENT], v[LG_CLIENT], clients) < 0))
            r = -1;
    }
    if (r == 0)
        result = Py_NewRef(Py_None);
    else if (r > 0)
        result = Py_NewRef(Py_NotImplemented);
    for (int i = 0; i < N; i++)
        Py_XDECREF(v[i]);
    Py_XDECREF(kept);
    Py_XDECREF(task);
    Py_XDECREF(packed);
    Py_XDECREF(bytes);
    Py_XDECREF(clients);
    Py_XDECREF(size_obj);
    return result;
}

static PyObject *
ledger_forget(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "ledger_forget takes 2 arguments (see LoadLedger._forget_py)");
        return NULL;
    }
    PyObject *ledger = args[0], *request_id = args[1];
    if (!PyUnicode_CheckExact(request_id))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *requests = NULL, *by_client = NULL, *held_obj = NULL, *bytes = NULL, *left = NULL, *result = NULL;
    PyObject *packed = NULL; /* borrowed from the table until it leaves it */
    int r = (requests = attr_get(ledger, lg_requests_name)) == NULL ? -1 : 0;
    if (r == 0 && !PyDict_CheckExact(requests))
        r = 1;
    if (r == 0 && (packed = PyDict_GetItemWithError(requests, request_id)) == NULL) {
        Py_DECREF(requests);
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE; /* not in flight: nothing changes */
    }
    long long size = 0, held = 0;
    PyObject *client = NULL;
    if (r == 0 && (!PyTuple_CheckExact(packed) || PyTuple_GET_SIZE(packed) < LG_CANDIDATES
                   || !PyLong_CheckExact(PyTuple_GET_ITEM(packed, LG_SIZE)) || dl_long_arg(PyTuple_GET_ITEM(packed, LG_SIZE), &size)
                   || !PyUnicode_CheckExact(client = PyTuple_GET_ITEM(packed, LG_CLIENT))))
        r = 1;
    if (r == 0 && ((by_client = attr_get(ledger, lg_by_client_name)) == NULL
                   || (held_obj = attr_get(ledger, lg_inflight_bytes_name)) == NULL))
        r = -1;
    if (r == 0 && (!PyDict_CheckExact(by_client) || !PyLong_CheckExact(held_obj) || dl_long_arg(held_obj, &held)))
        r = 1;
    int has_client = r == 0 && PyUnicode_GET_LENGTH(client) > 0;
    long long count = 0;
    /* a client the count does not know: the reference raises its KeyError */
    if (has_client && (r = lg_count_plus(by_client, client, -1, 0, &count)) == 0 && count
        && (left = PyLong_FromLongLong(count)) == NULL)
        r = -1;
    if (r == 0 && (bytes = PyLong_FromLongLong(held - size)) == NULL)
        r = -1;
    if (r == 0) {
        /* _forget_py's order: out of the table, its bytes, the client's count */
        result = Py_NewRef(packed);
        if (PyDict_DelItem(requests, request_id) < 0 || attr_set(ledger, lg_inflight_bytes_name, bytes) < 0
            || (has_client && (left != NULL ? PyDict_SetItem(by_client, client, left)
                                            : PyDict_DelItem(by_client, client)) < 0))
            Py_CLEAR(result);
    }
    else if (r > 0)
        result = Py_NewRef(Py_NotImplemented);
    Py_XDECREF(requests);
    Py_XDECREF(by_client);
    Py_XDECREF(held_obj);
    Py_XDECREF(bytes);
    Py_XDECREF(left);
    return result;
}


/* ledger_admissible(ledger, req, max_inflight_per_client, max_inflight_bytes, max_id_length) -> bool
 *
 * router/ledger.py's LoadLedger.check_admissible on every Route, for a request it admits
 * without counting its bytes: True when its id is not in flight, its client has room, and
 * even at the most a request validated so far can cost (_check_admissible_py's `most`) the
 * table stays within max_inflight_bytes. False for anything else (a request near a limit, one
 * naming candidates, fields of other types), and the reference answers, raising its error or
 * counting the request's bytes exactly. tests/unit/test_ledger_table.py holds it to the
 * reference. */
static PyObject *la_waiting_bytes_name; /* the ledger's bytes held by requests waiting for admission */

static PyObject *
ledger_admissible(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    long long per_client, byte_limit, max_id;
    if (nargs != 5 || dl_long_arg(args[2], &per_client) || dl_long_arg(args[3], &byte_limit)
        || dl_long_arg(args[4], &max_id)) {
        PyErr_SetString(PyExc_TypeError, "ledger_admissible(ledger, req, max_inflight_per_client, max_inflight_bytes, "
                                         "max_id_length)");
        return NULL;
    }
    if (!lg_k.set)
        Py_RETURN_FALSE;
    PyObject *ledger = args[0], *req = args[1];
    PyObject *rid = NULL, *client = NULL, *keys = NULL, *candidates = NULL, *table = NULL, *held_obj = NULL;
    PyObject *waiting_obj = NULL, *result = NULL;
    int r = (rid = attr_get(req, lg_request_id_name)) == NULL || (client = attr_get(req, lg_client_name)) == NULL ? -1 : 0;
    if (r == 0 && (!PyUnicode_CheckExact(rid) || !PyUnicode_CheckExact(client)))
        r = 1;
    if (r == 0 && PyUnicode_GET_LENGTH(rid)) { /* not in flight already */
        if ((table = attr_get(ledger, lg_requests_name)) == NULL)
            r = -1;
        else if (!PyDict_CheckExact(table))
            r = 1;
        else if ((r = PyDict_Contains(table, rid)) > 0)
            r = 1;
        Py_CLEAR(table);
    }
    if (r == 0 && per_client && PyUnicode_GET_LENGTH(client)) { /* the client's requests in flight */
        long long count = 0;
        if ((table = attr_get(ledger, lg_by_client_name)) == NULL)
            r = -1;
        else if (!PyDict_CheckExact(table))
            r = 1;
        else if ((r = lg_count_plus(table, client, 0, 1, &count)) == 0 && count >= per_client)
            r = 1;
        Py_CLEAR(table);
    }
    if (r == 0 && byte_limit) { /* the most such a request costs, beside what is held */
        long long held, waiting, most;
        Py_ssize_t n_keys;
        if ((held_obj = attr_get(ledger, lg_inflight_bytes_name)) == NULL
            || (waiting_obj = attr_get(ledger, la_waiting_bytes_name)) == NULL || (keys = attr_get(req, lg_keys_name)) == NULL
            || (candidates = attr_get(req, lg_candidates_name)) == NULL)
            r = -1;
        else if (dl_long_arg(held_obj, &held) || dl_long_arg(waiting_obj, &waiting) || !PyTuple_CheckExact(candidates)
                 || PyTuple_GET_SIZE(candidates))
            r = 1;
        else if ((n_keys = PyObject_Size(keys)) < 0)
            r = -1;
        else if (__builtin_mul_overflow((long long)n_keys, lg_k.list_key_bytes, &most)
                 || __builtin_add_overflow(most, lg_k.entry_bytes + 5 * max_id + PyUnicode_GET_LENGTH(client), &most)
                 || __builtin_add_overflow(most, held, &most) || __builtin_add_overflow(most, waiting, &most)
                 || most > byte_limit)
            r = 1;
    }
    if (r >= 0)
        result = Py_NewRef(r == 0 ? Py_True : Py_False);
    Py_XDECREF(rid);
    Py_XDECREF(client);
    Py_XDECREF(keys);
    Py_XDECREF(candidates);
    Py_XDECREF(held_obj);
    Py_XDECREF(waiting_obj);
    return result;
}

/* deadline_admit(guard, ctx, chosen, request_id, slo_ms, none_claimed) -> Pricing | None | NotImplemented
 *
 * DeadlineGuard.admit_chosen (deadline.py), on every Route under deadline admission: the prompt's
 * tokens on `chosen` read from the RoutingContext `ctx` as its uncached_tokens and overlap do,
 * deadline_price's answer for them, and for a choice that meets the SLO on_admitted's record of
 * the request. Its reference is price_chosen then on_admitted (_admit_py); `none_claimed` is
 * policies.base.NONE_CLAIMED, the claims of a context with no speculative blocks. Declines
 * (NotImplemented, nothing changed) what it does not read: a context or worker of other types,
 * claims in anything but a dict, books that are not an OrderedDict. tests/unit/test_deadline_books.py
 * holds it to the reference. */
static PyObject *da_overlaps_name, *da_claimed_name, *da_request_name, *da_now_name;
static FieldOffsets ctx_fields, ctx_req, ctx_worker;

/* What RoutingContext `ctx` (policies/base.py) says of the prompt on `worker`: overlap(worker)
 * blocks, uncached_tokens(worker) and the cached tokens (overlap * block_size), and the
 * context's request and now (borrowed). `none_claimed`: policies.base.NONE_CLAIMED, the claims
 * of a context with no speculative blocks. 0; 1 when the context or the worker is not of the
 * types read here (claims in anything but a dict, overlaps in neither a dict nor Overlaps);
 * -1 with an error. */
static int
ctx_prompt_on(PyObject *ctx, PyObject *worker, PyObject *none_claimed, long long *overlap_out, long long *uncached_out,
              long long *cached_out, PyObject **req_out, PyObject **now_out)
{
    PyObject *const ctx_names[] = {da_overlaps_name, da_claimed_name, da_request_name, block_size_name, da_now_name};
    field_offsets(&ctx_fields, Py_TYPE(ctx), ctx_names, 5);
    PyObject *v[5];
    for (int i = 0; i < 5; i++)
        if (ctx_fields.at[i] < 0 || (v[i] = *(PyObject **)((char *)ctx + ctx_fields.at[i])) == NULL)
            return 1;
    PyObject *overlaps = v[0], *claimed = v[1], *req = v[2];
    PyObject *const req_names[] = {lg_prompt_tokens_name};
    field_offsets(&ctx_req, Py_TYPE(req), req_names, 1);
    PyObject *const worker_names[] = {slot_name};
    field_offsets(&ctx_worker, Py_TYPE(worker), worker_names, 1);
    PyObject *prompt_obj = ctx_req.at[0] < 0 ? NULL : *(PyObject **)((char *)req + ctx_req.at[0]);
    PyObject *slot_obj = ctx_worker.at[0] < 0 ? NULL : *(PyObject **)((char *)worker + ctx_worker.at[0]);
    long long block_size, prompt, slot, overlap = 0, held = 0;
    if (prompt_obj == NULL || slot_obj == NULL || dl_long_arg(v[3], &block_size) || dl_long_arg(prompt_obj, &prompt)
        || dl_long_arg(slot_obj, &slot))
        return 1;
    /* ctx.overlap(worker), and the speculative blocks it claims there (uncached_tokens) */
    int r = 0;
    if (Py_IS_TYPE(overlaps, &OverlapsType))
        overlap = overlaps_depth((OverlapsObject *)overlaps, slot);
    else
        r = PyDict_CheckExact(overlaps) ? scan_depth(overlaps, NULL, slot_obj, &overlap) : 1;
    if (r == 0 && claimed != none_claimed)
        r = PyDict_CheckExact(claimed) ? scan_depth(claimed, NULL, slot_obj, &held) : 1;
    long long cached_blocks, uncached, cached;
    if (r == 0 && (__builtin_sub_overflow(overlap, held, &cached_blocks)
                   || __builtin_mul_overflow(cached_blocks, block_size, &uncached)
                   || __builtin_sub_overflow(prompt, uncached, &uncached) || __builtin_mul_overflow(overlap, block_size, &cached)))
        r = 1;
    if (r != 0)
        return r;
    *overlap_out = overlap;
    *uncached_out = uncached < 0 ? 0 : uncached;
    *cached_out = cached;
    *req_out = req;
    *now_out = v[4];
    return 0;
}

static PyObject *
deadline_admit(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "deadline_admit takes 6 arguments (see DeadlineGuard._admit_py)");
        return NULL;
    }
    PyObject *guard = args[0], *ctx = args[1], *chosen = args[2], *request_id = args[3], *slo_obj = args[4];
    double slo_ms, now;
    if (!dl_k.set || !PyUnicode_CheckExact(request_id) || verdict_double(slo_obj, &slo_ms))
        Py_RETURN_NOTIMPLEMENTED;
    long long overlap, uncached, cached;
    PyObject *req, *now_obj;
    int r = ctx_prompt_on(ctx, chosen, args[5], &overlap, &uncached, &cached, &req, &now_obj);
    if (r == 0 && verdict_double(now_obj, &now))
        r = 1;
    if (r != 0)
        return r < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    /* the record's book, checked before pricing changes anything (a re-anchor, the prefill memo) */
    PyObject *judged = NULL, *uncached_obj = NULL, *cached_obj = NULL, *priced = NULL;
    int records = PyUnicode_GET_LENGTH(request_id) > 0;
    if (records && (judged = attr_get(guard, dl_judged_name)) == NULL)
        return NULL;
    if (records && !PyODict_CheckExact(judged)) {
        priced = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if ((uncached_obj = PyLong_FromLongLong(uncached)) == NULL || (cached_obj = PyLong_FromLongLong(cached)) == NULL)
        goto done;
    priced = dl_price(guard, chosen, uncached, cached, now, slo_ms, now_obj, uncached_obj, cached_obj);
    if (priced == NULL || !PyTuple_CheckExact(priced) || !records)
        goto done;
    /* on_admitted: its outcome will move the margin */
    PyObject *admitted[] = {Py_NewRef(slo_obj), Py_NewRef(now_obj)};
    if (dl_set_new(judged, request_id, dl_tuple(2, admitted)) < 0)
        Py_CLEAR(priced);
    else if (PyDict_GET_SIZE(judged) > dl_k.max_tracked) {
        PyObject *gone = PyObject_CallMethodOneArg(judged, dl_popitem_name, Py_False);
        if (gone == NULL)
            Py_CLEAR(priced);
        Py_XDECREF(gone);
    }
done:
    Py_XDECREF(judged);
    Py_XDECREF(uncached_obj);
    Py_XDECREF(cached_obj);
    return priced;
}

/* ---- the in-flight table: a Route's charge, a Complete's release ----------------------------
 *
 * registry_charge(registry, worker, request_id, prefill_tokens, prompt_tokens, overlap_blocks,
 *                 started_at, policy) -> None | NotImplemented
 * registry_release(registry, request_id, new_inflight) -> InFlight | NotImplemented
 *
 * index/workers.py's WorkerRegistry.charge and .release, on every Route and every Complete: the
 * request's seven-field entry in the table (`_inflight` by id, `_inflight_order` oldest first)
 * and its worker's load in the worker's SlotLoads (SlotLoad above). Each does what its
 * reference (_charge_py, _release_py) does, for arguments of their exact types, where the
 * reference's conversions to str, int and float hand back the very objects; for anything else,
 * a request already in flight (charge) or not in flight (release), NotImplemented before
 * anything changes, and the reference runs (raising its Conflict or NotFound). In bytecode the
 * two were ~110 opcodes, seven conversions and four SlotLoad reads and writes a Route +
 * Complete. tests/unit/test_inflight_table.py holds them to the references. */
static PyObject *wr_inflight_name, *wr_order_name, *wr_workers_name, *wr_append_name;
static PyTypeObject *wr_deque_type; /* collections.deque */
static FieldOffsets wr_worker; /* a Worker's id, slot and slot_loads, read in place */

/* `worker`'s id (borrowed), store (borrowed) and slot: 0; 1 when it has not those members of
 * their exact types, or a slot out of the stores' range */
static int
wr_worker_fields(PyObject *worker, PyObject **id, SlotLoadsObject **loads, Py_ssize_t *slot)
{
    PyObject *const names[] = {id_name, slot_name, slot_loads_name};
    field_offsets(&wr_worker, Py_TYPE(worker), names, 3);
    PyObject *values[3];
    for (int i = 0; i < 3; i++) {
        if (wr_worker.at[i] < 0 || (values[i] = *(PyObject **)((char *)worker + wr_worker.at[i])) == NULL)
            return 1;
    }
    long long n;
    if (!PyUnicode_CheckExact(values[0]) || dl_long_arg(values[1], &n) || n < 0 || n >= SLOT_LOADS_MAX
        || !Py_IS_TYPE(values[2], &SlotLoadsType))
        return 1;
    *id = values[0];
    *loads = (SlotLoadsObject *)values[2];
    *slot = (Py_ssize_t)n;
    return 0;
}

/* registry.<name> as an exact dict (a new reference): NULL with an error, or NULL without one
 * when it is anything else */
static PyObject *
wr_dict(PyObject *registry, PyObject *name)
{
    PyObject *d = attr_get(registry, name);
    if (d != NULL && !PyDict_CheckExact(d))
        Py_CLEAR(d);
    return d;
}

static PyObject *
registry_charge(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "registry_charge takes 8 arguments (see WorkerRegistry._charge_py)");
        return NULL;
    }
    PyObject *registry = args[0], *worker = args[1], *request_id = args[2], *policy = args[7];
    long long prefill, prompt, overlap;
    PyObject *worker_id;
    SlotLoadsObject *loads;
    Py_ssize_t slot;
    if (!PyUnicode_CheckExact(request_id) || dl_long_arg(args[3], &prefill) || dl_long_arg(args[4], &prompt)
        || dl_long_arg(args[5], &overlap) || !PyFloat_CheckExact(args[6]) || !PyUnicode_CheckExact(policy)
        || wr_worker_fields(worker, &worker_id, &loads, &slot))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *inflight = wr_dict(registry, wr_inflight_name);
    if (inflight == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_NotImplemented);
    /* ours: the tuple below may run a collection, whose finalizers could replace the members */
    Py_INCREF(worker_id);
    Py_INCREF(loads);
    PyObject *order = attr_get(registry, wr_order_name), *kept = NULL, *result = NULL;
    /* made first: the one allocation that may run a collection (and its finalizers), before
     * the table and the loads are read */
    if (order == NULL || slot_loads_reserve(loads, slot) < 0
        || (kept = PyTuple_Pack(7, request_id, worker_id, args[3], args[4], args[5], args[6], policy)) == NULL)
        goto done;
    int held = PyDict_Contains(inflight, request_id);
    if (held < 0)
        goto done;
    /* the worker's loads after this request, which the reference's ints would hold too */
    int64_t requests = slot_load(loads, 0, slot), tokens = slot_load(loads, 1, slot);
    if (held || !Py_IS_TYPE(order, wr_deque_type) || __builtin_add_overflow(requests, 1, &requests)
        || __builtin_add_overflow(tokens, (int64_t)prefill, &tokens)) {
        result = Py_NewRef(Py_NotImplemented); /* in flight: the reference's Conflict */
        goto done;
    }
    if (PyDict_SetItem(inflight, request_id, kept) < 0)
        goto done;
    PyObject *appended = PyObject_CallMethodOneArg(order, wr_append_name, kept);
    if (appended == NULL) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (PyDict_DelItem(inflight, request_id) < 0)
            PyErr_Clear();
        PyErr_Restore(type, value, tb);
        goto done;
    }
    Py_DECREF(appended);
    loads->values[slot] = requests; /* column 0: requests in flight; column 1: prefill tokens */
    loads->values[loads->capacity + slot] = tokens;
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(inflight);
    Py_DECREF(worker_id);
    Py_DECREF(loads);
    Py_XDECREF(order);
    Py_XDECREF(kept);
    return result;
}

static PyObject *
registry_release(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "registry_release takes 3 arguments (see WorkerRegistry._release_py)");
        return NULL;
    }
    PyObject *registry = args[0], *request_id = args[1], *new_inflight = args[2];
    if (!PyUnicode_CheckExact(request_id))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *inflight = wr_dict(registry, wr_inflight_name), *workers = NULL, *entry = NULL, *result = NULL;
    if (inflight == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_NotImplemented);
    if ((workers = wr_dict(registry, wr_workers_name)) == NULL) {
        if (!PyErr_Occurred())
            result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    entry = PyDict_GetItemWithError(inflight, request_id);
    long long tokens;
    if (entry == NULL || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 7
        || !PyUnicode_CheckExact(PyTuple_GET_ITEM(entry, 1)) || dl_long_arg(PyTuple_GET_ITEM(entry, 2), &tokens)) {
        entry = NULL;
        if (!PyErr_Occurred()) /* not in flight: the reference's NotFound */
            result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    Py_INCREF(entry); /* ours: it leaves the table */
    PyObject *worker = PyDict_GetItemWithError(workers, PyTuple_GET_ITEM(entry, 1)); /* borrowed */
    PyObject *worker_id; /* read with the loads, not needed: the entry names the worker */
    SlotLoadsObject *loads = NULL;
    Py_ssize_t slot = 0;
    int64_t requests = 0, pending = 0;
    if (worker == NULL && PyErr_Occurred())
        goto done;
    if (worker != NULL && (wr_worker_fields(worker, &worker_id, &loads, &slot)
                           || __builtin_sub_overflow(slot_load(loads, 0, slot), 1, &requests)
                           || __builtin_sub_overflow(slot_load(loads, 1, slot), (int64_t)tokens, &pending))) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if ((loads != NULL && slot_loads_reserve(loads, slot) < 0) || PyDict_DelItem(inflight, request_id) < 0)
        goto done;
    if (loads != NULL) {
        loads->values[slot] = requests;
        loads->values[loads->capacity + slot] = pending;
    }
    result = PyObject_Vectorcall(new_inflight, &PyTuple_GET_ITEM(entry, 0), 7, NULL);
done:
    Py_DECREF(inflight);
    Py_XDECREF(workers);
    Py_XDECREF(entry);
    return result;
}

/* ---- what a commit charges and counts --------------------------------------------------------
 *
 * ledger_commit(ledger, decision, ctx, worker, registry, counters, none_claimed) -> None | NotImplemented
 *
 * router/ledger.py's LoadLedger.commit, on every Route, charges and counts the decision it commits
 * (its reference, _commit_py): the decision's overlap on `worker` (ctx.overlap), the policy's
 * prefix-hit record (_count_prefix_hit), the charge to the worker (registry_charge: its uncached
 * tokens, none for a disaggregated decision's decode hop), the request kept in the table
 * (ledger_keep, or where that declines _keep_py) and the decision counted (counters["decisions"],
 * decisions_by_policy). In bytecode that was ~130 opcodes and five Python calls a Route. Declines
 * (NotImplemented, before anything is written) what the reference answers itself: a policy
 * without its PrefixHits yet (the reference makes it), counts that are not exact ints, a
 * context registry_charge or ctx_prompt_on does not read, a request already in flight (the
 * reference's Conflict). tests/unit/test_ledger_table.py holds it to the reference. */
static PyObject *lc_prefix_hits_name, *lc_by_policy_name, *lc_overlap_blocks_name, *lc_prefill_name, *lc_match_name,
    *lc_path_name, *lc_decisions_key, *lc_keep_py_name;
enum { LC_BEST, LC_WORSE, LC_NO_PREFIX, LC_ACHIEVED, LC_REACHABLE, LC_HITS };
static PyObject *lc_hit_names[LC_HITS];

static PyObject *
ledger_commit(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "ledger_commit takes 7 arguments (see LoadLedger._commit_py)");
        return NULL;
    }
    PyObject *ledger = args[0], *decision = args[1], *ctx = args[2], *worker = args[3], *registry = args[4],
             *counters = args[5];
    long long overlap, uncached, cached;
    PyObject *req, *now_obj;
    int r = ctx_prompt_on(ctx, worker, args[6], &overlap, &uncached, &cached, &req, &now_obj);
    if (r != 0)
        return r < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    /* ours: the charge and the keep below may run Python code (a collection, _keep_py) */
    Py_INCREF(req);
    Py_INCREF(now_obj);
    /* every read first, each a new reference; then the new counts, made before anything is written */
    enum { POLICY, PREFILL, MATCH, PATH, HITS_TABLE, BY_POLICY, REQUEST_ID, PROMPT, HITS, READ };
    PyObject *v[READ] = {NULL}, *hit[LC_HITS] = {NULL}, *now_hit[LC_HITS] = {NULL};
    PyObject *overlap_obj = NULL, *prefill_obj = NULL, *decided_obj = NULL, *by_policy_obj = NULL, *result = NULL;
    if ((v[POLICY] = attr_get(decision, lg_policy_name)) == NULL || (v[PREFILL] = attr_get(decision, lc_prefill_name)) == NULL
        || (v[MATCH] = attr_get(ctx, lc_match_name)) == NULL || (v[PATH] = attr_get(v[MATCH], lc_path_name)) == NULL
        || (v[HITS_TABLE] = attr_get(ledger, lc_prefix_hits_name)) == NULL
        || (v[BY_POLICY] = attr_get(ledger, lc_by_policy_name)) == NULL
        || (v[REQUEST_ID] = attr_get(req, lg_request_id_name)) == NULL || (v[PROMPT] = attr_get(req, lg_prompt_tokens_name)) == NULL)
        r = -1;
    else if (!PyUnicode_CheckExact(v[POLICY]) || !PyList_CheckExact(v[PATH]) || !PyDict_CheckExact(v[HITS_TABLE])
             || !PyDict_CheckExact(v[BY_POLICY]) || !PyDict_CheckExact(counters) || !PyFloat_CheckExact(now_obj))
        r = 1;
    else if ((v[HITS] = Py_XNewRef(PyDict_GetItemWithError(v[HITS_TABLE], v[POLICY]))) == NULL)
        r = PyErr_Occurred() ? -1 : 1; /* the policy's first decision: the reference makes its record */
    long long n[LC_HITS], reachable = r == 0 ? PyList_GET_SIZE(v[PATH]) : 0, decided = 0, by_policy = 0;
    for (int i = 0; i < LC_HITS && r == 0; i++) {
        if ((hit[i] = attr_get(v[HITS], lc_hit_names[i])) == NULL)
            r = -1;
        else if (dl_long_arg(hit[i], &n[i]))
            r = 1;
    }
    /* _count_prefix_hit: no prefix anywhere, or the chosen worker's share of the longest */
    int changed[LC_HITS] = {0};
    if (r == 0 && !reachable) {
        if (__builtin_add_overflow(n[LC_NO_PREFIX], 1, &n[LC_NO_PREFIX]))
            r = 1;
        changed[LC_NO_PREFIX] = 1;
    }
    else if (r == 0) {
        int which = overlap >= reachable ? LC_BEST : LC_WORSE;
        if (__builtin_add_overflow(n[which], 1, &n[which]) || __builtin_add_overflow(n[LC_ACHIEVED], overlap, &n[LC_ACHIEVED])
            || __builtin_add_overflow(n[LC_REACHABLE], reachable, &n[LC_REACHABLE]))
            r = 1;
        changed[which] = changed[LC_ACHIEVED] = changed[LC_REACHABLE] = 1;
    }
    if (r == 0)
        r = lg_count_plus(counters, lc_decisions_key, 1, 0, &decided);
    if (r == 0)
        r = lg_count_plus(v[BY_POLICY], v[POLICY], 1, 1, &by_policy);
    for (int i = 0; i < LC_HITS && r == 0; i++)
        if (changed[i] && (now_hit[i] = PyLong_FromLongLong(n[i])) == NULL)
            r = -1;
    if (r == 0 && ((overlap_obj = PyLong_FromLongLong(overlap)) == NULL
                   || (prefill_obj = PyLong_FromLongLong(v[PREFILL] == Py_None ? uncached : 0)) == NULL
                   || (decided_obj = PyLong_FromLongLong(decided)) == NULL
                   || (by_policy_obj = PyLong_FromLongLong(by_policy)) == NULL))
        r = -1;
    if (r != 0) {
        if (r > 0)
            result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    /* the charge, which declines a request in flight before it changes anything */
    PyObject *charge[] = {registry, worker, v[REQUEST_ID], prefill_obj, v[PROMPT], overlap_obj, now_obj, v[POLICY]};
    PyObject *charged = registry_charge(module, charge, 8);
    if (charged == NULL || charged == Py_NotImplemented) {
        result = charged;
        goto done;
    }
    Py_DECREF(charged);
    PyObject *keep[] = {ledger, req};
    PyObject *kept = ledger_keep(module, keep, 2);
    if (kept == Py_NotImplemented) {
        Py_DECREF(kept);
        kept = PyObject_CallMethodOneArg(ledger, lc_keep_py_name, req);
    }
    if (kept == NULL)
        goto done;
    Py_DECREF(kept);
    if (attr_set(decision, lc_overlap_blocks_name, overlap_obj) < 0)
        goto done;
    for (int i = 0; i < LC_HITS; i++)
        if (now_hit[i] != NULL && attr_set(v[HITS], lc_hit_names[i], now_hit[i]) < 0)
            goto done;
    if (PyDict_SetItem(counters, lc_decisions_key, decided_obj) < 0 || PyDict_SetItem(v[BY_POLICY], v[POLICY], by_policy_obj) < 0)
        goto done;
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < READ; i++)
        Py_XDECREF(v[i]);
    for (int i = 0; i < LC_HITS; i++) {
        Py_XDECREF(hit[i]);
        Py_XDECREF(now_hit[i]);
    }
    Py_XDECREF(overlap_obj);
    Py_XDECREF(prefill_obj);
    Py_XDECREF(decided_obj);
    Py_XDECREF(by_policy_obj);
    Py_DECREF(req);
    Py_DECREF(now_obj);
    return result;
}

/* ledger_finish(ledger, registry, request_id, success, speculative, new_inflight)
 *     -> (InFlight, PackedRequest | None) | NotImplemented
 *
 * What every Complete releases (LoadLedger._finish; its reference, _finish_py): the request's
 * charge to its worker (registry_release), its entry in the table (ledger_forget, or where that
 * declines _forget_py) and, where it holds speculative blocks, their end
 * (SpeculativeBlocks.ended, called only for a request it has claims of). Three Python calls
 * and ~60 bytecodes a Complete. Declines (NotImplemented, nothing changed) what registry_release
 * declines: a request not in flight (the reference's NotFound), arguments not of its types. */
static PyObject *lf_by_request_name, *lf_ended_name, *lf_forget_py_name;

static PyObject *
ledger_finish(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "ledger_finish takes 6 arguments (see LoadLedger._finish_py)");
        return NULL;
    }
    PyObject *ledger = args[0], *request_id = args[2], *success = args[3], *speculative = args[4];
    PyObject *claims = attr_get(speculative, lf_by_request_name);
    if (claims == NULL)
        return NULL;
    if (!PyDict_CheckExact(claims)) {
        Py_DECREF(claims);
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *release[] = {args[1], request_id, args[5]};
    PyObject *entry = registry_release(module, release, 3), *packed = NULL, *result = NULL;
    if (entry == NULL || entry == Py_NotImplemented) {
        Py_DECREF(claims);
        return entry;
    }
    PyObject *forget[] = {ledger, request_id};
    packed = ledger_forget(module, forget, 2);
    if (packed == Py_NotImplemented) {
        Py_DECREF(packed);
        packed = PyObject_CallMethodOneArg(ledger, lf_forget_py_name, request_id);
    }
    int claimed = packed == NULL ? -1 : PyDict_Contains(claims, request_id);
    if (claimed > 0) {
        PyObject *ended = PyObject_CallMethodObjArgs(speculative, lf_ended_name, request_id, success, NULL);
        if (ended == NULL)
            claimed = -1;
        Py_XDECREF(ended);
    }
    if (claimed >= 0)
        result = PyTuple_Pack(2, entry, packed);
    Py_DECREF(claims);
    Py_DECREF(entry);
    Py_XDECREF(packed);
    return result;
}

/* ledger_request_id(ledger, rng) -> str | NotImplemented
 *
 * LoadLedger.new_request_id (its reference, _new_request_id_py), for every Route that came
 * without an id (the SDK's default, ext_proc without x-request-id): the ledger's counter one up,
 * then 32 bits of the router's rng, as "kvr-<counter, hex>-<bits, 8 hex digits>". The f-string's
 * two formatted ints were ~4k instructions (callgrind), more than the rest of the id. Declines a
 * counter that is not an exact int below 2^63. */
static PyObject *lr_counter_name, *lr_getrandbits_name, *lr_bits;

static PyObject *
ledger_request_id(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "ledger_request_id takes 2 arguments (see LoadLedger._new_request_id_py)");
        return NULL;
    }
    PyObject *counter = attr_get(args[0], lr_counter_name), *next = NULL;
    if (counter == NULL)
        return NULL;
    long long n;
    int unread = dl_long_arg(counter, &n) || n < 0 || n == LLONG_MAX;
    Py_DECREF(counter);
    if (unread)
        Py_RETURN_NOTIMPLEMENTED;
    /* the reference's order: the counter moves, then the rng draws */
    if ((next = PyLong_FromLongLong(n + 1)) == NULL || attr_set(args[0], lr_counter_name, next) < 0) {
        Py_XDECREF(next);
        return NULL;
    }
    Py_DECREF(next);
    PyObject *bits = PyObject_CallMethodOneArg(args[1], lr_getrandbits_name, lr_bits);
    if (bits == NULL)
        return NULL;
    unsigned long long b = PyLong_AsUnsignedLongLong(bits);
    Py_DECREF(bits);
    if (b == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    /* written out: snprintf's format parsing was ~2.7k of the id's ~3.1k instructions */
    static const char hex[] = "0123456789abcdef";
    char text[4 + 16 + 1 + 8];
    unsigned long long count = (unsigned long long)n + 1;
    int digits = 1;
    while (digits < 16 && (count >> (4 * digits)) != 0)
        digits++;
    memcpy(text, "kvr-", 4);
    for (int i = 0; i < digits; i++)
        text[4 + i] = hex[(count >> (4 * (digits - 1 - i))) & 0xf];
    text[4 + digits] = '-';
    for (int i = 0; i < 8; i++) /* 32 bits, as the reference's :08x of getrandbits(32) */
        text[5 + digits + i] = hex[(b >> (4 * (7 - i))) & 0xf];
    return PyUnicode_FromStringAndSize(text, 13 + digits);
}

/* ---- cache_aware's pick -----------------------------------------------------------------------
 *
 * cache_aware_pick(policy, ctx, overlap_rule, abs_threshold, rel_threshold, cache_threshold,
 *                  load_name, new_decision, name) -> Decision | NotImplemented
 *
 * policies/routing/cache_aware.py's CacheAwarePolicy.select for a decision nobody will read the
 * record of (ctx.explain false) with the KV-use triggers off, the router's default policy on
 * every such Route; its reference is _select_py there. The caller works out the match rule
 * (`overlap_rule`: "overlap", else "threshold") and hands the parameters. One pass: the
 * candidates' scan (prefix_scan), the load spread, then the least loaded (fewest_counted_at_load),
 * the most cached blocks (prefix_ties, then the smaller cache) or the longest match above the
 * threshold, and the Decision made with `new_decision` (the dataclass's slots filler), the
 * choice kept as policy._chosen for on_dispatch. In bytecode: ~170 opcodes and four Python calls
 * a Route. NotImplemented (nothing changed) where a pass it runs declines, or for loads past
 * 2^53 (the reference compares them with floats exactly); tests/unit/policies/test_cache_aware_pick.py
 * holds it to the reference. */
static PyObject *ca_candidates_name, *ca_slots_name, *ca_index_name, *ca_counts_name, *ca_processed_name,
    *ca_by_slot_name, *ca_owner_name, *ca_chosen_name, *ca_reasons[4];
enum { CA_IMBALANCED, CA_PREFIX_MATCH, CA_NO_OVERLAP, CA_LOW_MATCH };

/* the chosen index out of an answer of fewest_counted_at_load: 0, 1 to decline, -1 */
static int
ca_index_of(PyObject *answer, Py_ssize_t n, Py_ssize_t *i)
{
    if (answer == NULL)
        return -1;
    long long v;
    int r = answer == Py_NotImplemented || dl_long_arg(answer, &v) || v < 0 || v >= n;
    if (r == 0)
        *i = (Py_ssize_t)v;
    Py_DECREF(answer);
    return r;
}

static PyObject *
cache_aware_pick(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "cache_aware_pick takes 9 arguments (see CacheAwarePolicy._select_py)");
        return NULL;
    }
    PyObject *policy = args[0], *ctx = args[1], *load_name = args[6];
    int overlap_rule = PyObject_IsTrue(args[2]);
    double abs_t, rel_t, cache_t;
    if (overlap_rule < 0)
        return NULL;
    if (verdict_double(args[3], &abs_t) || verdict_double(args[4], &rel_t) || verdict_double(args[5], &cache_t)
        || !PyUnicode_CheckExact(load_name))
        Py_RETURN_NOTIMPLEMENTED;
    enum { CANDIDATES, OVERLAPS, SLOTS, REQUEST, BLOCK_SIZE, PROMPT, PROCESSED, BY_SLOT, OWNERS, SCAN, READ };
    PyObject *v[READ] = {NULL}, *result = NULL;
    if ((v[CANDIDATES] = attr_get(ctx, ca_candidates_name)) == NULL || (v[OVERLAPS] = attr_get(ctx, da_overlaps_name)) == NULL
        || (v[SLOTS] = attr_get(ctx, ca_slots_name)) == NULL || (v[REQUEST] = attr_get(ctx, da_request_name)) == NULL
        || (v[BLOCK_SIZE] = attr_get(ctx, block_size_name)) == NULL
        || (v[PROMPT] = attr_get(v[REQUEST], lg_prompt_tokens_name)) == NULL
        || (v[PROCESSED] = attr_get(policy, ca_processed_name)) == NULL || (v[BY_SLOT] = attr_get(policy, ca_by_slot_name)) == NULL
        || (v[OWNERS] = attr_get(policy, ca_owner_name)) == NULL)
        goto done;
    long long block_size, prompt;
    if (!PyList_CheckExact(v[CANDIDATES]) || !PyList_GET_SIZE(v[CANDIDATES]) || dl_long_arg(v[BLOCK_SIZE], &block_size)
        || dl_long_arg(v[PROMPT], &prompt)) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    PyObject *candidates = v[CANDIDATES];
    Py_ssize_t n = PyList_GET_SIZE(candidates);
    PyObject *scan_args[] = {candidates, v[OVERLAPS], load_name, v[SLOTS]};
    if ((v[SCAN] = prefix_scan(module, scan_args, 4)) == NULL)
        goto done;
    Py_ssize_t best_i, min_i, i = -1;
    long long scanned[5], best_depth, min_load, max_load; /* best_i, best_depth, min_i, min_load, max_load */
    int unread = v[SCAN] == Py_NotImplemented || !PyTuple_CheckExact(v[SCAN]) || PyTuple_GET_SIZE(v[SCAN]) != 5;
    for (int k = 0; k < 5 && !unread; k++)
        unread = dl_long_arg(PyTuple_GET_ITEM(v[SCAN], k), &scanned[k]);
    if (unread || scanned[0] < 0 || scanned[0] >= n || scanned[2] < 0 || scanned[2] >= n
        || llabs(scanned[3]) >= (1LL << 53) || llabs(scanned[4]) >= (1LL << 53)) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    best_i = (Py_ssize_t)scanned[0], best_depth = scanned[1], min_i = (Py_ssize_t)scanned[2];
    min_load = scanned[3], max_load = scanned[4];
    /* the candidates' slots where the selector made them (a snapshot of this very list) */
    const CandidateSlotsObject *slots = Py_IS_TYPE(v[SLOTS], &CandidateSlotsType) && Py_SIZE(v[SLOTS]) == n
        ? (const CandidateSlotsObject *)v[SLOTS] : NULL;
    int reason, r = 0;
    /* SGLang's is_imbalanced: both spreads past their thresholds (the reference's int-float
     * comparisons, exact for loads below 2^53) */
    int imbalanced = (double)(max_load - min_load) > abs_t && (double)max_load > rel_t * (double)min_load;
    if (!imbalanced && overlap_rule && best_depth > 0) {
        /* score_overlap: the most cached blocks, then the lower load, then the smaller cache */
        reason = CA_PREFIX_MATCH;
        PyObject *load = PyObject_GetAttr(PyList_GET_ITEM(candidates, best_i), load_name), *ties = NULL, *start = NULL,
                 *depth = NULL, *counts = NULL, *index = NULL;
        if (load == NULL || (start = PyLong_FromSsize_t(best_i + 1)) == NULL || (depth = PyLong_FromLongLong(best_depth)) == NULL)
            r = -1;
        else {
            PyObject *tie_args_[] = {candidates, v[OVERLAPS], load_name, start, depth, load, v[SLOTS]};
            ties = prefix_ties(module, tie_args_, 7);
            if (ties == NULL)
                r = -1;
            else if (ties == Py_NotImplemented || !PyList_CheckExact(ties))
                r = 1;
        }
        if (r == 0 && PyList_GET_SIZE(ties)) {
            if ((index = PyObject_GetAttr(ctx, ca_index_name)) == NULL || (counts = PyObject_GetAttr(index, ca_counts_name)) == NULL)
                r = -1;
        }
        /* the first of the smallest caches, in candidate order */
        long long fewest = 0;
        i = best_i;
        for (Py_ssize_t t = -1; r == 0 && t < (ties == NULL ? 0 : PyList_GET_SIZE(ties)); t++) {
            if (t < 0 && counts == NULL)
                break; /* no ties: the best is chosen without reading its cache */
            long long at;
            if (t >= 0 && (dl_long_arg(PyList_GET_ITEM(ties, t), &at) || at < 0 || at >= n)) {
                r = 1;
                break;
            }
            Py_ssize_t c = t < 0 ? best_i : (Py_ssize_t)at;
            PyObject *slot = slots != NULL ? PyLong_FromUnsignedLong(slots->slots[c])
                                           : PyObject_GetAttr(PyList_GET_ITEM(candidates, c), slot_name), *cached = NULL;
            long long size;
            if (slot == NULL || (cached = PyObject_GetItem(counts, slot)) == NULL)
                r = -1;
            else if (dl_long_arg(cached, &size))
                r = 1;
            else if (t < 0 || size < fewest) {
                fewest = size;
                i = c;
            }
            Py_XDECREF(slot);
            Py_XDECREF(cached);
        }
        Py_XDECREF(load);
        Py_XDECREF(ties);
        Py_XDECREF(start);
        Py_XDECREF(depth);
        Py_XDECREF(counts);
        Py_XDECREF(index);
    }
    else if (!imbalanced && !overlap_rule
             && (prompt < 1 ? fmin(1.0, (double)(best_depth * block_size)) : fmin(1.0, (double)(best_depth * block_size) / (double)prompt)) > cache_t) {
        reason = CA_PREFIX_MATCH;
        i = best_i;
    }
    else {
        /* min_load_idx: fewest in flight, then fewest sent here, then the lower slot */
        reason = imbalanced ? CA_IMBALANCED : overlap_rule ? CA_NO_OVERLAP : CA_LOW_MATCH;
        PyObject *start = PyLong_FromSsize_t(min_i), *load = start == NULL ? NULL : PyLong_FromLongLong(min_load);
        if (load == NULL)
            r = -1;
        else {
            PyObject *fewest_args[] = {candidates, v[OVERLAPS], load_name, start, load, v[PROCESSED], v[SLOTS],
                                       v[BY_SLOT], v[OWNERS]};
            r = ca_index_of(fewest_counted_at_load(module, fewest_args, 9), n, &i);
        }
        Py_XDECREF(start);
        Py_XDECREF(load);
    }
    if (r != 0) {
        if (r > 0)
            result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if (i >= PyList_GET_SIZE(candidates)) { /* a getter above shrank the list: the reference reads it again */
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    PyObject *chosen = PyList_GET_ITEM(candidates, i), *id = NULL, *slot = NULL, *listed = NULL, *attributes = NULL;
    long long overlap = 0;
    Py_INCREF(chosen);
    if ((id = PyObject_GetAttr(chosen, id_name)) == NULL
        || (slot = slots != NULL ? PyLong_FromUnsignedLong(slots->slots[i]) : PyObject_GetAttr(chosen, slot_name)) == NULL)
        r = -1;
    else if (Py_IS_TYPE(v[OVERLAPS], &OverlapsType)) {
        long long s;
        if (dl_long_arg(slot, &s))
            r = 1;
        else
            overlap = overlaps_depth((OverlapsObject *)v[OVERLAPS], s);
    }
    else
        r = PyDict_CheckExact(v[OVERLAPS]) ? scan_depth(v[OVERLAPS], NULL, slot, &overlap) : 1;
    PyObject *overlap_obj = NULL;
    if (r == 0 && ((listed = PyList_New(0)) == NULL || (attributes = PyDict_New()) == NULL
                   || (overlap_obj = PyLong_FromLongLong(overlap)) == NULL))
        r = -1;
    if (r == 0) {
        /* Decision's fields in declaration order, as the reference's _new_decision call */
        PyObject *fields[] = {id, args[8], ca_reasons[reason], listed, overlap_obj, empty_str, float_zero, attributes,
                              empty_str, empty_str, Py_None, empty_str, zero, zero};
        result = PyObject_Vectorcall(args[7], fields, 14, NULL);
        if (result != NULL && attr_set(policy, ca_chosen_name, chosen) < 0)
            Py_CLEAR(result);
    }
    else if (r > 0)
        result = Py_NewRef(Py_NotImplemented);
    Py_DECREF(chosen);
    Py_XDECREF(id);
    Py_XDECREF(slot);
    Py_XDECREF(listed);
    Py_XDECREF(attributes);
    Py_XDECREF(overlap_obj);
done:
    for (int k = 0; k < READ; k++)
        Py_XDECREF(v[k]);
    return result;
}

/* ---- a Route's own checks, passed or not -----------------------------------------------------
 *
 * route_check_constants(max_ttft_slo_ms, max_output_tokens, max_workers, hop_prefix) -> None
 * route_checked(req, max_prompt_tokens, block_size, max_id_length) -> bool
 *
 * router/selector.py's Selector.validate_request runs its checks of the request itself (its
 * prompt's size, its SLO and output, its ids' lengths, its candidates) on every Route, before
 * the ledger's; in bytecode ~5k instructions. route_checked answers True when the request
 * passes every one of them with fields of their exact types, so the reference (_validate_py)
 * would raise nothing; False for anything else, and the caller runs the reference, which raises
 * the first failing check's error, or passes a request of types read only there (a float
 * expected_output_tokens, keys of another sequence type). tests/unit/test_route_checks.py holds
 * it to the reference over random requests, valid and each way invalid. */
static struct {
    double max_ttft_slo_ms;
    long long max_output_tokens, max_workers;
    Py_UCS4 hop_prefix;
    int set;
} rc_k;

static FieldOffsets rc_req;

static PyObject *
route_check_constants(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    double ttft;
    long long output, workers;
    if (nargs != 4 || verdict_double(args[0], &ttft) || dl_long_arg(args[1], &output) || dl_long_arg(args[2], &workers)
        || !PyUnicode_CheckExact(args[3]) || PyUnicode_GET_LENGTH(args[3]) < 1) {
        PyErr_SetString(PyExc_TypeError, "route_check_constants(max_ttft_slo_ms, max_output_tokens, max_workers, "
                                         "hop_prefix) (see selector.py)");
        return NULL;
    }
    rc_k.max_ttft_slo_ms = ttft;
    rc_k.max_output_tokens = output;
    rc_k.max_workers = workers;
    rc_k.hop_prefix = PyUnicode_READ_CHAR(args[3], 0);
    rc_k.set = 1;
    Py_RETURN_NONE;
}

/* a sequence's length when reading it runs no Python code (a list, a tuple, an array): 0, or 1 */
static inline int
rc_length(PyObject *keys, Py_ssize_t *n)
{
    if (PyList_CheckExact(keys) || PyTuple_CheckExact(keys) || Py_IS_TYPE(keys, Py_TYPE(array_q_zero))) {
        *n = PyObject_Size(keys);
        return *n < 0;
    }
    return 1;
}

static PyObject *
route_checked(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    long long max_prompt, block_size, limit;
    if (nargs != 4 || dl_long_arg(args[1], &max_prompt) || dl_long_arg(args[2], &block_size)
        || dl_long_arg(args[3], &limit)) {
        PyErr_SetString(PyExc_TypeError, "route_checked(req, max_prompt_tokens, block_size, max_id_length): ints");
        return NULL;
    }
    if (!rc_k.set || block_size <= 0)
        Py_RETURN_FALSE;
    PyObject *req = args[0];
    /* the fields read, the five ids first */
    PyObject *const names[] = {lg_request_id_name, lg_session_id_name, lg_model_name, lg_policy_name, lg_lora_name,
                               lg_prompt_tokens_name, lg_keys_name, lg_ttft_slo_ms_name, lg_output_name,
                               lg_candidates_name};
    enum { N = sizeof names / sizeof names[0], IDS = 5, PROMPT = 5, KEYS, SLO, OUTPUT, CANDIDATES };
    PyObject *v[N] = {NULL};
    field_offsets(&rc_req, Py_TYPE(req), names, N);
    int r = 1; /* 1 while every check passes, 0 once one does not, -1 on error */
    for (int i = 0; i < N && r == 1; i++)
        if ((v[i] = member_get(req, rc_req.at[i], names[i])) == NULL)
            r = -1;
    long long prompt = 0, output = 0;
    double slo = 0.0;
    Py_ssize_t n_keys = 0;
    if (r == 1 && (!PyLong_CheckExact(v[PROMPT]) || dl_long_arg(v[PROMPT], &prompt) || prompt <= 0 || prompt > max_prompt
                   || rc_length(v[KEYS], &n_keys) || n_keys > prompt / block_size || verdict_double(v[SLO], &slo)
                   || !(0.0 <= slo && slo <= rc_k.max_ttft_slo_ms) || !PyLong_CheckExact(v[OUTPUT])
                   || dl_long_arg(v[OUTPUT], &output) || output < 0 || output > rc_k.max_output_tokens))
        r = PyErr_Occurred() ? -1 : 0;
    for (int i = 0; i < IDS && r == 1; i++)
        if (!PyUnicode_CheckExact(v[i]) || PyUnicode_GET_LENGTH(v[i]) > limit)
            r = 0;
    if (r == 1 && PyUnicode_GET_LENGTH(v[0]) && PyUnicode_READ_CHAR(v[0], 0) == rc_k.hop_prefix)
        r = 0; /* the ledger's prefill-hop ids start so */
    if (r == 1) {
        PyObject *c = v[CANDIDATES];
        if (!PyTuple_CheckExact(c) || PyTuple_GET_SIZE(c) > rc_k.max_workers)
            r = 0;
        for (Py_ssize_t i = 0; r == 1 && i < PyTuple_GET_SIZE(c); i++)
            if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(c, i)) || PyUnicode_GET_LENGTH(PyTuple_GET_ITEM(c, i)) > limit)
                r = 0;
    }
    for (int i = 0; i < N; i++)
        Py_XDECREF(v[i]);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}


/* ---- a Route's request from its message, the prompt packed ------------------------------------
 *
 * route_request_packed(msg, new_request, tasks, adapter_bases, max_id_length, max_prompt_tokens,
 *                      block_size, client) -> RouteRequest | NotImplemented
 *
 * server/convert.py's route_request for the form gateways and the SDK send: the prompt as
 * token_ids_le32 (no token_ids, no block_keys), a known task, ids within max_id_length, the
 * prompt within max_prompt_tokens. Its reference is convert._route_request_py, which answers
 * everything else (the other forms, and the errors, in its order of checks). What it reads of the
 * message it reads once (the Python read model, lora and cache_salt twice), and the prompt is
 * keyed as Selector.keys_for_tokens keys it: an adapter named in `model` under its base from
 * `adapter_bases()` (called only then), salted by namespace_seed_of, hashed into an array('Q').
 * The request is built by `new_request` (convert._new_route_request) from `tasks` (number ->
 * TaskCategory). tests/unit/server/test_route_conversion.py holds the two to equal requests. */
static PyObject *rr_token_ids_name, *rr_block_keys_name, *rr_le32_name, *rr_cache_salt_name;

/* ---- a message's fields in one call -----------------------------------------------------------
 *
 * message_layouts(route_request_class, complete_request_class) -> None
 *
 * route_request_packed and completion_of read 13 and 10 fields of a protobuf message; by name,
 * each was ~430 instructions of upb's lookup (a name hashed, its field found, its value made).
 * A Route sets one or two of them and a Complete a few, so both take the message's
 * ListFields() (the fields set, with their descriptors) and the default of each field left
 * out, from a layout made once per message class: its fields' descriptors -> their places in
 * the pass's list, and what an unset field reads as (a repeated field's default is an empty
 * tuple: the passes take its length, or a tuple of it). A message of another class is read by
 * name. server/convert.py hands the classes over at its import; None clears a layout. */
typedef struct {
    PyTypeObject *type;  /* the message class (a strong reference), NULL: no layout */
    PyObject *places;    /* dict: FieldDescriptor -> its place (an int) in the pass's list */
    PyObject *defaults;  /* tuple: what each place reads as when its field is not set */
} MessageLayout;
static MessageLayout rr_layout, cp_layout;
static PyObject *cp_names[10]; /* CompleteRequest's fields, as completion_of reads them */
static PyObject *list_fields_name, *descriptor_name, *fields_by_name_name;
#define RR_FIELDS {rr_le32_name, rr_token_ids_name, rr_block_keys_name, lg_task_name, lg_model_name, lg_lora_name, \
                   rr_cache_salt_name, lg_request_id_name, lg_session_id_name, lg_ttft_slo_ms_name, lg_output_name, \
                   lg_policy_name, lg_candidates_name}

/* `l` made for the message class `cls` (or cleared, for None), its fields `names[0:n]`: 0, or -1 */
static int
message_layout(MessageLayout *l, PyObject *cls, PyObject *const *names, int n)
{
    if (cls == Py_None) {
        Py_CLEAR(l->type);
        Py_CLEAR(l->places);
        Py_CLEAR(l->defaults);
        return 0;
    }
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "message_layouts takes message classes (or None)");
        return -1;
    }
    PyObject *descriptor = PyObject_GetAttr(cls, descriptor_name);
    PyObject *by_name = descriptor == NULL ? NULL : PyObject_GetAttr(descriptor, fields_by_name_name);
    PyObject *blank = by_name == NULL ? NULL : PyObject_CallNoArgs(cls);
    PyObject *places = blank == NULL ? NULL : PyDict_New();
    PyObject *defaults = places == NULL ? NULL : PyTuple_New(n);
    int r = defaults == NULL ? -1 : 0;
    for (int i = 0; i < n && r == 0; i++) {
        PyObject *field = PyObject_GetItem(by_name, names[i]);
        PyObject *place = field == NULL ? NULL : PyLong_FromLong(i);
        PyObject *value = place == NULL ? NULL : PyObject_GetAttr(blank, names[i]);
        if (value == NULL || PyDict_SetItem(places, field, place) < 0)
            r = -1;
        else {
            if (!PyUnicode_Check(value) && !PyBytes_Check(value) && !PyLong_Check(value) && !PyFloat_Check(value))
                Py_SETREF(value, PyTuple_New(0)); /* a repeated field */
            if (value == NULL)
                r = -1;
            else
                PyTuple_SET_ITEM(defaults, i, Py_NewRef(value));
        }
        Py_XDECREF(field);
        Py_XDECREF(place);
        Py_XDECREF(value);
    }
    if (r == 0) {
        Py_XSETREF(l->type, (PyTypeObject *)Py_NewRef(cls));
        Py_XSETREF(l->places, Py_NewRef(places));
        Py_XSETREF(l->defaults, Py_NewRef(defaults));
    }
    Py_XDECREF(descriptor);
    Py_XDECREF(by_name);
    Py_XDECREF(blank);
    Py_XDECREF(places);
    Py_XDECREF(defaults);
    return r;
}

static PyObject *
message_layouts(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "message_layouts(route_request_class, complete_request_class)");
        return NULL;
    }
    PyObject *const route[] = RR_FIELDS;
    if (message_layout(&rr_layout, args[0], route, (int)(sizeof route / sizeof route[0])) < 0
        || message_layout(&cp_layout, args[1], cp_names, 10) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* `msg`'s fields by `l` into v[0:n] (new references; v all NULL before): 0; 1 when `l` is not
 * for msg's class (v untouched: read them by name); -1 with an error (v all NULL again) */
static int
message_fields(const MessageLayout *l, PyObject *msg, PyObject **v)
{
    if (l->type == NULL || !Py_IS_TYPE(msg, l->type))
        return 1;
    PyObject *listed = PyObject_CallMethodNoArgs(msg, list_fields_name);
    if (listed == NULL)
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(l->defaults);
    int r = PyList_CheckExact(listed) ? 0 : -1;
    for (Py_ssize_t i = 0; r == 0 && i < PyList_GET_SIZE(listed); i++) {
        PyObject *item = PyList_GET_ITEM(listed, i);
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2) {
            r = -1;
            break;
        }
        PyObject *place = PyDict_GetItemWithError(l->places, PyTuple_GET_ITEM(item, 0)); /* borrowed */
        if (place == NULL) {
            r = PyErr_Occurred() ? -1 : 0; /* a field this pass does not read */
            continue;
        }
        long at = PyLong_AsLong(place);
        if (at >= 0 && at < n && v[at] == NULL)
            v[at] = Py_NewRef(PyTuple_GET_ITEM(item, 1));
    }
    Py_DECREF(listed);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (r < 0)
            Py_CLEAR(v[i]);
        else if (v[i] == NULL)
            v[i] = Py_NewRef(PyTuple_GET_ITEM(l->defaults, i));
    }
    if (r < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "ListFields() answered something other than (field, value) pairs");
    return r;
}

/* `msg`'s first n fields into v[0:n] (new references; v all NULL before): a message's as
 * message_fields reads them (its answers), or a batch item's as stream_batch_items read them (its
 * n fields, then where its own bytes are: 0); ITEM_FOR_REFERENCE for an item read as those three
 * alone (a prompt in the reference's forms) or of another size, which the reference parses */
enum { ITEM_FOR_REFERENCE = 2 };
static int
item_fields(const MessageLayout *l, PyObject *msg, PyObject **v, int n)
{
    if (!PyTuple_CheckExact(msg))
        return message_fields(l, msg, v);
    if (PyTuple_GET_SIZE(msg) != n + 3)
        return ITEM_FOR_REFERENCE;
    for (int i = 0; i < n; i++)
        v[i] = Py_NewRef(PyTuple_GET_ITEM(msg, i));
    return 0;
}

static PyObject *
route_request_packed(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    long long limit, max_prompt, block_size;
    if (nargs != 8 || dl_long_arg(args[4], &limit) || dl_long_arg(args[5], &max_prompt)
        || dl_long_arg(args[6], &block_size) || !PyDict_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "route_request_packed(msg, new_request, tasks, adapter_bases, max_id_length, "
                                         "max_prompt_tokens, block_size, client)");
        return NULL;
    }
    PyObject *msg = args[0], *new_request = args[1], *tasks = args[2], *adapter_bases = args[3], *client = args[7];
    if (block_size <= 0)
        Py_RETURN_NOTIMPLEMENTED;
    /* the prompt's forms, the task, the three names that key it, then the rest */
    PyObject *const names[] = RR_FIELDS;
    enum { N = sizeof names / sizeof names[0], LE32 = 0, TOKENS, KEYS, TASK, MODEL, LORA, SALT, RID, SESSION, SLO,
           OUTPUT, POLICY, CANDIDATES };
    PyObject *v[N] = {NULL};
    PyObject *keys = NULL, *candidates = NULL, *prompt = NULL, *result = NULL, *bases = NULL;
    PyObject *model, *lora; /* borrowed: v[MODEL], v[LORA] or the adapter's base and name */
    int r = 0;
    Py_ssize_t n_bytes = 0;
    const char *packed = NULL; /* the prompt's bytes: v[LE32]'s, or its view's */
    Py_buffer view = {NULL};
    int by_name = item_fields(&rr_layout, msg, v, N); /* 0: all read at once */
    if (by_name == ITEM_FOR_REFERENCE)
        Py_RETURN_NOTIMPLEMENTED;
    if (by_name < 0)
        r = -1;
    for (int i = 0; i < N && r == 0; i++) {
        if (by_name && (v[i] = PyObject_GetAttr(msg, names[i])) == NULL)
            r = -1;
        else if (i == LE32) {
            if (PyBytes_CheckExact(v[i])) {
                packed = PyBytes_AS_STRING(v[i]);
                n_bytes = PyBytes_GET_SIZE(v[i]);
            }
            else if (PyMemoryView_Check(v[i])) {
                if (PyObject_GetBuffer(v[i], &view, PyBUF_SIMPLE) < 0)
                    r = -1;
                else {
                    packed = view.buf;
                    n_bytes = view.len;
                }
            }
            r = r ? r : packed == NULL || n_bytes == 0 || n_bytes % 4;
        }
        else if (i == TOKENS || i == KEYS) {
            Py_ssize_t n = PyObject_Size(v[i]);
            r = n < 0 ? -1 : n > 0; /* the other forms, or more than one: the reference answers */
        }
        else if (i == MODEL || i == LORA || i == SALT)
            r = !PyUnicode_CheckExact(v[i]) || PyUnicode_GET_LENGTH(v[i]) > limit;
    }
    PyObject *task = NULL; /* borrowed from `tasks` */
    long long n_tokens = n_bytes / 4;
    if (r == 0 && ((task = PyDict_GetItemWithError(tasks, v[TASK])) == NULL || n_tokens > max_prompt))
        r = PyErr_Occurred() ? -1 : 1;
    model = v[MODEL];
    lora = v[LORA];
    if (r == 0 && PyUnicode_GET_LENGTH(model) && !PyUnicode_GET_LENGTH(lora)) {
        /* keys.key_namespace: an adapter named in `model` is keyed as its engine stores it */
        PyObject *base = NULL;
        if ((bases = PyObject_CallNoArgs(adapter_bases)) == NULL)
            r = -1;
        else if (!PyDict_CheckExact(bases))
            r = 1;
        else if ((base = PyDict_GetItemWithError(bases, model)) == NULL)
            r = PyErr_Occurred() ? -1 : 0;
        else {
            lora = model;
            model = base;
        }
    }
    uint64_t seed = 0;
    if (r == 0 && !namespace_seed_of(model, lora, v[SALT], &seed))
        r = 1;
    if (r == 0 && (keys = chain_array(packed, (Py_ssize_t)(block_size * 4),
                                      (Py_ssize_t)(n_tokens / block_size), seed)) == NULL)
        r = -1;
    Py_ssize_t n_candidates = r == 0 ? PyObject_Size(v[CANDIDATES]) : 0;
    if (r == 0 && (n_candidates < 0 || (prompt = PyLong_FromLongLong(n_tokens)) == NULL
                   || (candidates = n_candidates ? PySequence_Tuple(v[CANDIDATES]) : PyTuple_New(0)) == NULL))
        r = -1;
    if (r == 0) {
        /* every field in declaration order (convert._new_route_request) */
        PyObject *fields[] = {v[RID], keys, prompt, v[SESSION], task, v[SLO], v[OUTPUT], v[POLICY], candidates,
                              v[MODEL], v[LORA], client};
        result = PyObject_Vectorcall(new_request, fields, sizeof fields / sizeof fields[0], NULL);
    }
    else if (r > 0)
        result = Py_NewRef(Py_NotImplemented);
    for (int i = 0; i < N; i++)
        Py_XDECREF(v[i]);
    Py_XDECREF(keys);
    Py_XDECREF(candidates);
    Py_XDECREF(prompt);
    Py_XDECREF(bases);
    if (view.obj != NULL)
        PyBuffer_Release(&view);
    return result;
}


/* ---- a Complete's completion from its message ------------------------------------------------
 *
 * completion_of(msg, new_completion, max_id_length, limits) -> Completion | NotImplemented
 *
 * server/convert.py's completion for a Complete every check passes: an id of at most
 * max_id_length characters (0: unchecked), each reported number within its bound (`limits`:
 * bounds.py's MAX_LATENCY_MS, MAX_OUTPUT_TOKENS, MAX_CACHED_TOKENS; check_completion's test
 * written out, a NaN never in range), built by `new_completion` (convert._new_completion) from
 * the ten fields in declaration order. Anything else goes to convert._completion_py, its
 * reference, which raises the first failing check's error as before. */

static PyObject *
completion_of(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    long long limit;
    double max_latency;
    long long max_output, max_cached;
    if (nargs != 4 || dl_long_arg(args[2], &limit) || !PyTuple_CheckExact(args[3]) || PyTuple_GET_SIZE(args[3]) != 3
        || verdict_double(PyTuple_GET_ITEM(args[3], 0), &max_latency) || dl_long_arg(PyTuple_GET_ITEM(args[3], 1), &max_output)
        || dl_long_arg(PyTuple_GET_ITEM(args[3], 2), &max_cached)) {
        PyErr_SetString(PyExc_TypeError, "completion_of(msg, new_completion, max_id_length, (max_latency_ms, "
                                         "max_output_tokens, max_cached_tokens))");
        return NULL;
    }
    /* Completion's fields in declaration order: the id, four latencies at 1, 2, 7, 8, the two
     * token counts at 3 (cached, -1 = unknown) and 4 */
    enum { N = 10, CACHED = 3, OUTPUT = 4 };
    static const int latencies[] = {1, 2, 7, 8};
    PyObject *v[N] = {NULL}, *result = NULL;
    int r = 0;
    int by_name = item_fields(&cp_layout, args[0], v, N); /* 0: all read at once */
    if (by_name == ITEM_FOR_REFERENCE)
        Py_RETURN_NOTIMPLEMENTED;
    if (by_name < 0)
        r = -1;
    for (int i = 0; by_name > 0 && i < N && r == 0; i++)
        if ((v[i] = PyObject_GetAttr(args[0], cp_names[i])) == NULL)
            r = -1;
    if (r == 0 && (!PyUnicode_CheckExact(v[0]) || PyUnicode_GET_LENGTH(v[0]) == 0
                   || (limit && PyUnicode_GET_LENGTH(v[0]) > limit)))
        r = 1;
    for (size_t i = 0; r == 0 && i < sizeof latencies / sizeof latencies[0]; i++) {
        PyObject *ms = v[latencies[i]];
        if (!PyFloat_CheckExact(ms) || !(0.0 <= PyFloat_AS_DOUBLE(ms) && PyFloat_AS_DOUBLE(ms) <= max_latency))
            r = 1;
    }
    long long cached = 0, output = 0;
    if (r == 0 && (!PyLong_CheckExact(v[CACHED]) || dl_long_arg(v[CACHED], &cached) || cached < -1 || cached > max_cached
                   || !PyLong_CheckExact(v[OUTPUT]) || dl_long_arg(v[OUTPUT], &output) || output < 0
                   || output > max_output))
        r = 1;
    if (r == 0)
        result = PyObject_Vectorcall(args[1], v, N, NULL);
    else if (r > 0)
        result = Py_NewRef(Py_NotImplemented);
    for (int i = 0; i < N; i++)
        Py_XDECREF(v[i]);
    return result;
}

/* ---- a RouteStream batch read from its wire bytes ---------------------------------------------
 *
 * stream_batch_items(data, max_items) -> list[(item_id, kind, fields)] | None
 *
 * server/stream_wire.py's reader of a RouteStreamRequest that is a batch of 1 to max_items
 * Routes and Completes. Parsed by upb, each item's fields were then read back by
 * route_request_packed and completion_of through ListFields, and the items themselves through
 * attribute and oneof lookups, the prompt copied into a new bytes on the way: read here, the
 * daemon's code per streamed Route + Complete is 126k instructions, not 145k. Here each item
 * is read straight from the bytes into the tuple those passes take in place of a message: a
 * Route's 13 fields in RR_FIELDS order (its prompt a memoryview of `data`, not a copy; token_ids
 * and block_keys empty), a Complete's 10 in declaration order, each followed by where the
 * item's own message (a RouteRequest, a CompleteRequest) is: `data`, its start and its end,
 * which upb parses when a pass declines the item (convert.route_request, convert.completion;
 * as ints, not a view: a memoryview slice costs ~1k instructions). A Route with its prompt in
 * another form (token_ids, block_keys), which the packed pass leaves to the reference anyway,
 * is those three alone. kind: "route" or "complete".
 *
 * As read_event_batch, only the plain form that encoders write is read, and None leaves
 * everything else to upb, so where this answers it answers as upb does: a field that is not
 * the schema's or not with its wire type (unknown fields, groups, an item that is itself a
 * batch), any field given twice but candidate_workers, token_ids and block_keys (protobuf merges
 * a message, keeps the last scalar, and a oneof's last member), an item with neither route nor
 * complete, a malformed or cut varint or length, a tag or length of more than five bytes, a
 * string that is not strict UTF-8, a varint out of its field's range (upb keeps a uint32's low
 * 32 bits, an int32's low 32 bits, any non-zero bool as true), and a batch of no items or of
 * more than max_items, which the handler refuses whole under the batch's id as before.
 * tests/unit/server/test_stream_wire.py holds it to upb. */
static PyObject *sb_kind_route, *sb_kind_complete;

/* The batch being read: its bytes (`data`, from `base`) and a memoryview of them (`whole`) */
typedef struct {
    PyObject *data, *whole;
    const unsigned char *base;
} SbBatch;

/* The memoryview of the batch's bytes over `part` (a slice of `whole`: ~1k instructions) */
static inline PyObject *
sb_view(const SbBatch *b, WireReader part)
{
    return PySequence_GetSlice(b->whole, part.p - b->base, part.end - b->base);
}

/* `part`, a message of the batch, as the last three places of `out` from `at`: the batch's
 * bytes and the message's start and end in them (stream_wire.as_message parses them) */
static inline int
sb_own(const SbBatch *b, WireReader part, PyObject *out, Py_ssize_t at)
{
    PyObject *start = PyLong_FromSsize_t(part.p - b->base), *end = PyLong_FromSsize_t(part.end - b->base);
    if (start == NULL || end == NULL) {
        Py_XDECREF(start);
        Py_XDECREF(end);
        return -1;
    }
    PyTuple_SET_ITEM(out, at, Py_NewRef(b->data));
    PyTuple_SET_ITEM(out, at + 1, start);
    PyTuple_SET_ITEM(out, at + 2, end);
    return 0;
}

/* Route's and Complete's fields, by field number: where the pass reads each (a place in its
 * tuple; SB_IGNORED: read and checked, not kept; SB_DECLINED: left to upb; SB_REFERENCE: a
 * prompt form the passes leave to the reference, checked as upb checks it, the Route then read
 * as its bytes alone) and its wire type */
enum { SB_IGNORED = -1, SB_DECLINED = -2, SB_REFERENCE = -3, SB_U32 = 8, SB_I32, SB_I64, SB_BOOL };
typedef struct {
    signed char place;
    unsigned char type; /* WIRE_VARINT, WIRE_FIXED64, WIRE_LEN */
    unsigned char range; /* a varint's: SB_U32, SB_I32, SB_I64 or SB_BOOL */
} SbField;

/* A Route's or Complete's fields from `w` (its message's bytes) as the tuple of `n` places then
 * where the message is (sb_own), by `layout` (field numbers 1 to n_fields), with what an unset
 * field reads as (`defaults`, n of them); `repeated`: the one field that may come more than
 * once, a string collected into a tuple in order (0: none). Returns the tuple, or where the
 * message is alone for one with an SB_REFERENCE field; Py_None to leave the batch to upb; NULL
 * with an error set. */
static PyObject *
sb_fields(WireReader w, const SbBatch *b, const SbField *layout, uint32_t n_fields,
          PyObject *const *defaults, int n, uint32_t repeated)
{
    PyObject *v[16] = {NULL}, *listed = NULL;
    int r = 0; /* 0: plain so far, 1: left to upb, -1: an error */
    int reference = 0; /* an SB_REFERENCE field was read */
    uint32_t seen = 0;
    WireReader own = w;
    while (r == 0 && w.p < w.end) {
        uint32_t field;
        unsigned type;
        if (wire_tag(&w, &field, &type) < 0 || field > n_fields || layout[field].place == SB_DECLINED) {
            r = 1;
            break;
        }
        if (layout[field].place == SB_REFERENCE) {
            /* token_ids (2: uint32 varints) or block_keys (3: fixed64s), packed in any number of
             * runs or each on its own, as upb reads them all */
            WireReader payload;
            uint64_t x;
            double d;
            reference = 1;
            if (type == WIRE_LEN && wire_bytes(&w, &payload) == 0) {
                if (field == 3)
                    r = (payload.end - payload.p) % 8 != 0;
                while (field == 2 && r == 0 && payload.p < payload.end)
                    r = wire_varint(&payload, &x) < 0;
            }
            else if (!((field == 2 && type == WIRE_VARINT && wire_varint(&w, &x) == 0)
                       || (field == 3 && type == WIRE_FIXED64 && wire_double(&w, &d) == 0)))
                r = 1;
            continue;
        }
        if (type != layout[field].type || (field != repeated && (seen >> field & 1))) {
            r = 1;
            break;
        }
        seen |= 1u << field;
        int at = layout[field].place;
        PyObject *value = NULL;
        if (type == WIRE_VARINT) {
            uint64_t x;
            unsigned range = layout[field].range;
            if (wire_varint(&w, &x) < 0 || (range == SB_U32 && x > 0xffffffffu) || (range == SB_BOOL && x > 1)
                || (range == SB_I32 && x > 0x7fffffffu && x < 0xffffffff80000000ull))
                r = 1;
            else if (at == SB_IGNORED)
                continue;
            else if (range == SB_BOOL)
                value = Py_NewRef(x ? Py_True : Py_False);
            else if (range == SB_I32)
                value = PyLong_FromLong((long)(int32_t)(uint32_t)x);
            else if (range == SB_I64)
                value = PyLong_FromLongLong((long long)x);
            else
                value = PyLong_FromUnsignedLongLong(x);
        }
        else if (type == WIRE_FIXED64) {
            double d;
            if (wire_double(&w, &d) < 0)
                r = 1;
            else
                value = PyFloat_FromDouble(d);
        }
        else {
            WireReader payload;
            if (wire_bytes(&w, &payload) < 0)
                r = 1;
            else if (defaults[at] != NULL && PyBytes_CheckExact(defaults[at]))
                value = sb_view(b, payload);
            else {
                int plain = 1; /* cleared: not strict UTF-8, which upb refuses */
                value = wire_str(payload, &plain);
                r = plain ? 0 : 1;
            }
        }
        if (r == 0 && value == NULL)
            r = -1;
        if (r != 0)
            break;
        if (field == repeated) {
            if (listed == NULL && (listed = PyList_New(0)) == NULL)
                r = -1;
            else if (PyList_Append(listed, value) < 0)
                r = -1;
            Py_DECREF(value);
        }
        else
            v[at] = value;
    }
    PyObject *out = NULL;
    if (r == 0 && reference) {
        if ((out = PyTuple_New(3)) != NULL && sb_own(b, own, out, 0) < 0)
            Py_CLEAR(out);
    }
    else if (r == 0 && (out = PyTuple_New(n + 3)) != NULL) {
        for (int i = 0; i < n; i++) {
            PyObject *value = v[i];
            v[i] = NULL;
            if (value == NULL) {
                value = defaults[i] != NULL ? Py_NewRef(defaults[i]) /* NULL: the repeated field */
                        : listed != NULL ? PyList_AsTuple(listed) : PyTuple_New(0);
            }
            if (value == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyTuple_SET_ITEM(out, i, value);
        }
        if (out != NULL && sb_own(b, own, out, n) < 0)
            Py_CLEAR(out);
    }
    else if (r > 0)
        out = Py_NewRef(Py_None);
    for (int i = 0; i < n; i++)
        Py_XDECREF(v[i]);
    Py_XDECREF(listed);
    return out;
}

/* RouteRequest's fields 1-14 -> RR_FIELDS' places (prompt_tokens is read and left out, as the
 * packed pass ignores it; token_ids and block_keys make the Route the reference's) */
enum { RR_LE32, RR_TOKENS, RR_KEYS, RR_TASK, RR_MODEL, RR_LORA, RR_SALT, RR_RID, RR_SESSION, RR_SLO, RR_OUTPUT,
       RR_POLICY, RR_CANDIDATES, RR_N };
static const SbField sb_route_layout[15] = {
    {SB_DECLINED, 0, 0},           {RR_RID, WIRE_LEN, 0},         {SB_REFERENCE, 0, 0},
    {SB_REFERENCE, 0, 0},          {SB_IGNORED, WIRE_VARINT, SB_U32}, {RR_MODEL, WIRE_LEN, 0},
    {RR_LORA, WIRE_LEN, 0},        {RR_SESSION, WIRE_LEN, 0},     {RR_TASK, WIRE_VARINT, SB_I32},
    {RR_SLO, WIRE_FIXED64, 0},     {RR_OUTPUT, WIRE_VARINT, SB_U32}, {RR_POLICY, WIRE_LEN, 0},
    {RR_CANDIDATES, WIRE_LEN, 0},  {RR_SALT, WIRE_LEN, 0},        {RR_LE32, WIRE_LEN, 0},
};
/* CompleteRequest's fields 1-10, each at its place (its number less one) */
static const SbField sb_complete_layout[11] = {
    {SB_DECLINED, 0, 0},     {0, WIRE_LEN, 0},        {1, WIRE_FIXED64, 0},    {2, WIRE_FIXED64, 0},
    {3, WIRE_VARINT, SB_I64}, {4, WIRE_VARINT, SB_U32}, {5, WIRE_VARINT, SB_BOOL}, {6, WIRE_VARINT, SB_BOOL},
    {7, WIRE_FIXED64, 0},    {8, WIRE_FIXED64, 0},    {9, WIRE_VARINT, SB_BOOL},
};
/* what unset fields read as (NULL: the repeated field, an empty tuple when absent), made at import */
static PyObject *sb_route_defaults[RR_N], *sb_complete_defaults[10];

/* One batch item (a RouteStreamRequest) from `w`: its (item_id, kind, fields); Py_None to leave
 * the batch to upb; NULL with an error set */
static PyObject *
sb_item(WireReader w, const SbBatch *b)
{
    uint64_t item_id = 0;
    uint32_t seen = 0;
    WireReader body = {NULL, NULL};
    while (w.p < w.end) {
        uint32_t field;
        unsigned type;
        uint64_t x;
        double d;
        if (wire_tag(&w, &field, &type) < 0 || field > 4 || (seen >> field & 1) || (field == 3 && (seen >> 2 & 1))
            || (field == 2 && (seen >> 3 & 1)))
            Py_RETURN_NONE;
        seen |= 1u << field;
        if (field == 1 && type == WIRE_VARINT && wire_varint(&w, &x) == 0)
            item_id = x;
        else if (field == 4 && type == WIRE_FIXED64 && wire_double(&w, &d) == 0)
            continue; /* timeout_ms: it bounds only a Route's wait in an admission queue */
        else if ((field == 2 || field == 3) && type == WIRE_LEN && wire_bytes(&w, &body) == 0)
            continue;
        else
            Py_RETURN_NONE;
    }
    PyObject *fields;
    int route = seen >> 2 & 1;
    if (route)
        fields = sb_fields(body, b, sb_route_layout, 14, sb_route_defaults, RR_N, 12);
    else if (seen >> 3 & 1)
        fields = sb_fields(body, b, sb_complete_layout, 10, sb_complete_defaults, 10, 0);
    else
        Py_RETURN_NONE; /* neither: the handler's answer to that comes from the message path */
    if (fields == NULL || fields == Py_None)
        return fields;
    PyObject *id = PyLong_FromUnsignedLongLong(item_id);
    PyObject *out = id == NULL ? NULL : PyTuple_Pack(3, id, route ? sb_kind_route : sb_kind_complete, fields);
    Py_XDECREF(id);
    Py_DECREF(fields);
    return out;
}

static PyObject *
stream_batch_items(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    long long max_items;
    if (nargs != 2 || !PyBytes_CheckExact(args[0]) || dl_long_arg(args[1], &max_items)) {
        PyErr_SetString(PyExc_TypeError, "stream_batch_items(data: bytes, max_items: int)");
        return NULL;
    }
    const unsigned char *base = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    WireReader w = {base, base + PyBytes_GET_SIZE(args[0])}, batch = {NULL, NULL};
    uint32_t seen = 0;
    while (w.p < w.end) { /* RouteStreamRequest: id, timeout_ms, and the batch, once each */
        uint32_t field;
        unsigned type;
        uint64_t x;
        double d;
        if (wire_tag(&w, &field, &type) < 0 || (seen >> (field & 31) & 1))
            Py_RETURN_NONE;
        seen |= 1u << (field & 31);
        if (!((field == 1 && type == WIRE_VARINT && wire_varint(&w, &x) == 0)
              || (field == 4 && type == WIRE_FIXED64 && wire_double(&w, &d) == 0)
              || (field == 5 && type == WIRE_LEN && wire_bytes(&w, &batch) == 0)))
            Py_RETURN_NONE;
    }
    if (batch.p == NULL || batch.p == batch.end)
        Py_RETURN_NONE;
    SbBatch b = {args[0], PyMemoryView_FromObject(args[0]), base};
    PyObject *items = b.whole == NULL ? NULL : PyList_New(0);
    while (items != NULL && batch.p < batch.end) { /* RouteStreamRequestBatch: its items */
        uint32_t field;
        unsigned type;
        WireReader item;
        PyObject *read = NULL;
        if (wire_tag(&batch, &field, &type) < 0 || field != 1 || type != WIRE_LEN || wire_bytes(&batch, &item) < 0
            || PyList_GET_SIZE(items) >= max_items)
            Py_SETREF(items, Py_NewRef(Py_None));
        else if ((read = sb_item(item, &b)) == NULL)
            Py_CLEAR(items);
        else if (read == Py_None)
            Py_SETREF(items, Py_NewRef(Py_None));
        else if (PyList_Append(items, read) < 0)
            Py_CLEAR(items);
        Py_XDECREF(read);
        if (items == Py_None)
            break;
    }
    Py_XDECREF(b.whole);
    return items;
}

/* ---- RouteStream batch answers ------------------------------------------------------------
 *
 * route_answer(item_id, result, block_size) -> bytes | NotImplemented
 * complete_answer(item_id) -> bytes
 *
 * server/convert.py's _route_answer_py and _complete_answer_py: one item of a RouteStream batch
 * answer (RouteStreamResponseBatch.items, field 1) with its tag and length, as upb serialises
 * RouteStreamResponse(id=item_id) with its `route` written by convert.route_response (or its
 * `complete` set): fields in number order, proto3 defaults left out, a double written whenever
 * its bits are not all zero. Building the answers as upb messages (an item added, nine fields
 * set, the batch serialised) was ~1.7 us of every streamed Route + Complete. route_answer
 * declines (NotImplemented, nothing changed) what the reference writes with more than this or
 * refuses: a prefill/decode hop (a decision with a pd_reason), a value of another type than
 * the dataclasses declare, a count past 2^32-1, a string that does not encode as UTF-8.
 * tests/unit/server/test_stream_answers.py holds both to the reference, byte for byte. */
static PyObject *ra_result_names[4]; /* request, decision, worker, alternative */
static PyObject *ra_request_names[2]; /* request_id, keys */
static PyObject *ra_decision_names[5]; /* overlap_blocks, policy, reason, estimated_ttft_ms, pd_reason */
static PyObject *ra_address_name;

typedef struct {
    const char *text;
    Py_ssize_t size;
} AnswerText;

static inline Py_ssize_t
varint_size(uint64_t v)
{
    Py_ssize_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static inline unsigned char *
put_varint(unsigned char *p, uint64_t v)
{
    while (v >= 0x80) {
        *p++ = (unsigned char)(v | 0x80);
        v >>= 7;
    }
    *p++ = (unsigned char)v;
    return p;
}

/* an exact str as UTF-8 into *t: 0; 1 for anything else (a str that does not encode: its
 * error cleared, the reference raises it) */
static int
answer_text(PyObject *value, AnswerText *t)
{
    if (!PyUnicode_CheckExact(value))
        return 1;
    t->text = PyUnicode_AsUTF8AndSize(value, &t->size);
    if (t->text == NULL) {
        PyErr_Clear();
        return 1;
    }
    return 0;
}

/* an exact int within uint32 into *out: 0; 1 otherwise */
static int
answer_count(PyObject *value, uint64_t *out)
{
    long long v;
    if (!PyLong_CheckExact(value) || dl_long_arg(value, &v) || v < 0 || v > 0xffffffffLL)
        return 1;
    *out = (uint64_t)v;
    return 0;
}

/* an answer's item id (RouteStreamResponse.id, a uint64) into *out: 0; -1 with an error */
static int
answer_id(PyObject *value, unsigned long long *out)
{
    if (!PyLong_CheckExact(value)) {
        PyErr_SetString(PyExc_TypeError, "an answer's item id must be an int");
        return -1;
    }
    *out = PyLong_AsUnsignedLongLong(value);
    return *out == (unsigned long long)-1 && PyErr_Occurred() ? -1 : 0;
}

/* the bytes of a length-delimited string field (tag one byte), 0 when the string is empty */
static inline Py_ssize_t
text_field_size(const AnswerText *t)
{
    return t->size ? 1 + varint_size((uint64_t)t->size) + t->size : 0;
}

static inline unsigned char *
put_text_field(unsigned char *p, unsigned char tag, const AnswerText *t)
{
    if (t->size) {
        *p++ = tag;
        p = put_varint(p, (uint64_t)t->size);
        memcpy(p, t->text, (size_t)t->size);
        p += t->size;
    }
    return p;
}

static inline unsigned char *
put_count_field(unsigned char *p, unsigned char tag, uint64_t v)
{
    if (v) {
        *p++ = tag;
        p = put_varint(p, v);
    }
    return p;
}

/* framed(item_id, field 2 or 3 holding `body` of `body_size` bytes): the item's bytes with
 * `body` left to the caller at the returned pointer (*at) */
static PyObject *
framed_answer(uint64_t item_id, unsigned char kind_tag, Py_ssize_t body_size, unsigned char **at)
{
    Py_ssize_t item = (item_id ? 1 + varint_size(item_id) : 0) + 1 + varint_size((uint64_t)body_size) + body_size;
    PyObject *out = PyBytes_FromStringAndSize(NULL, 1 + varint_size((uint64_t)item) + item);
    if (out == NULL)
        return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    *p++ = 0x0a; /* RouteStreamResponseBatch.items */
    p = put_varint(p, (uint64_t)item);
    if (item_id) {
        *p++ = 0x08; /* RouteStreamResponse.id */
        p = put_varint(p, item_id);
    }
    *p++ = kind_tag;
    *at = put_varint(p, (uint64_t)body_size);
    return out;
}

static PyObject *
route_answer(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    long long block_size;
    unsigned long long item_id;
    if (nargs != 3 || dl_long_arg(args[2], &block_size)) {
        PyErr_SetString(PyExc_TypeError, "route_answer(item_id, result, block_size)");
        return NULL;
    }
    if (answer_id(args[0], &item_id) < 0)
        return NULL;
    enum { REQUEST, DECISION, WORKER, ALTERNATIVE };
    enum { OVERLAP, POLICY, REASON, TTFT, PD_REASON };
    PyObject *of_result[4] = {NULL}, *request_id = NULL, *keys = NULL, *of_decision[5] = {NULL}, *worker_id = NULL,
             *spec = NULL, *address = NULL, *alt_id = NULL, *alt_address = NULL, *out = NULL;
    int r = 0;
    for (int i = 0; i < 4 && r == 0; i++)
        if ((of_result[i] = attr_get(args[1], ra_result_names[i])) == NULL)
            r = -1;
    for (int i = 0; i < 5 && r == 0; i++)
        if ((of_decision[i] = attr_get(of_result[DECISION], ra_decision_names[i])) == NULL)
            r = -1;
    if (r == 0 && ((request_id = attr_get(of_result[REQUEST], ra_request_names[0])) == NULL
                   || (keys = attr_get(of_result[REQUEST], ra_request_names[1])) == NULL
                   || (worker_id = attr_get(of_result[WORKER], id_name)) == NULL
                   || (spec = attr_get(of_result[WORKER], spec_name)) == NULL
                   || (address = attr_get(spec, ra_address_name)) == NULL))
        r = -1;
    if (r == 0 && of_result[ALTERNATIVE] != Py_None
        && ((alt_id = attr_get(of_result[ALTERNATIVE], id_name)) == NULL
            || (alt_address = PyObject_GetAttr(of_result[ALTERNATIVE], ra_address_name)) == NULL))
        r = -1;
    AnswerText texts[7] = {{NULL, 0}}; /* request_id, worker_id, address, alt id, alt address, policy, reason */
    enum { T_REQUEST, T_WORKER, T_ADDRESS, T_ALT_ID, T_ALT_ADDRESS, T_POLICY, T_REASON };
    uint64_t overlap = 0, prompt_blocks = 0;
    double ttft = 0.0;
    if (r == 0) {
        Py_ssize_t n_keys = PyObject_Length(keys);
        if (n_keys < 0)
            r = -1;
        else if (answer_text(request_id, &texts[T_REQUEST]) || answer_text(worker_id, &texts[T_WORKER])
                 || answer_text(address, &texts[T_ADDRESS]) || answer_text(of_decision[POLICY], &texts[T_POLICY])
                 || answer_text(of_decision[REASON], &texts[T_REASON])
                 || (alt_id != NULL && (answer_text(alt_id, &texts[T_ALT_ID])
                                        || answer_text(alt_address, &texts[T_ALT_ADDRESS])))
                 || answer_count(of_decision[OVERLAP], &overlap) || n_keys > 0xffffffffLL
                 || block_size < 0 || (block_size && overlap > 0xffffffffULL / (uint64_t)block_size)
                 || !PyFloat_CheckExact(of_decision[TTFT]) || !PyUnicode_CheckExact(of_decision[PD_REASON])
                 || PyUnicode_GET_LENGTH(of_decision[PD_REASON]) != 0)
            r = 1;
        else {
            prompt_blocks = (uint64_t)n_keys;
            ttft = PyFloat_AS_DOUBLE(of_decision[TTFT]);
        }
    }
    if (r == 0) {
        uint64_t matched_tokens = overlap * (uint64_t)block_size, ttft_bits;
        memcpy(&ttft_bits, &ttft, sizeof ttft_bits);
        Py_ssize_t size = 0;
        for (int i = 0; i < 7; i++)
            size += text_field_size(&texts[i]);
        size += (overlap ? 1 + varint_size(overlap) : 0) + (matched_tokens ? 1 + varint_size(matched_tokens) : 0)
                + (prompt_blocks ? 1 + varint_size(prompt_blocks) : 0) + (ttft_bits ? 9 : 0);
        unsigned char *p;
        out = framed_answer(item_id, 0x12, size, &p); /* RouteStreamResponse.route */
        if (out != NULL) {
            p = put_text_field(p, 0x0a, &texts[T_REQUEST]);
            p = put_text_field(p, 0x12, &texts[T_WORKER]);
            p = put_text_field(p, 0x1a, &texts[T_ADDRESS]);
            p = put_count_field(p, 0x20, overlap);
            p = put_count_field(p, 0x28, matched_tokens);
            p = put_count_field(p, 0x30, prompt_blocks);
            p = put_text_field(p, 0x3a, &texts[T_ALT_ID]);
            p = put_text_field(p, 0x42, &texts[T_ALT_ADDRESS]);
            p = put_text_field(p, 0x4a, &texts[T_POLICY]);
            p = put_text_field(p, 0x52, &texts[T_REASON]);
            if (ttft_bits) {
                *p++ = 0x59;
                memcpy(p, &ttft_bits, 8); /* little-endian, as the wire wants it on x86-64 and arm64 */
                p += 8;
            }
            assert(p == (unsigned char *)PyBytes_AS_STRING(out) + PyBytes_GET_SIZE(out));
        }
    }
    else if (r > 0)
        out = Py_NewRef(Py_NotImplemented);
    for (int i = 0; i < 4; i++)
        Py_XDECREF(of_result[i]);
    for (int i = 0; i < 5; i++)
        Py_XDECREF(of_decision[i]);
    Py_XDECREF(request_id);
    Py_XDECREF(keys);
    Py_XDECREF(worker_id);
    Py_XDECREF(spec);
    Py_XDECREF(address);
    Py_XDECREF(alt_id);
    Py_XDECREF(alt_address);
    return out;
}

static PyObject *
complete_answer(PyObject *module, PyObject *arg)
{
    unsigned long long item_id;
    if (answer_id(arg, &item_id) < 0)
        return NULL;
    unsigned char *p;
    return framed_answer(item_id, 0x1a, 0, &p); /* RouteStreamResponse.complete, empty */
}

/* ---- a streamed Complete in one call ----------------------------------------------------------
 *
 * stream_complete(plan, item_id, msg) -> bytes | NotImplemented
 *
 * A RouteStream batch's Complete (`msg`: its message, or its fields as stream_batch_items read
 * them), applied and answered: what GatewayCalls._stream_item's Complete does through
 * convert.completion, Router.complete_anywhere, LoadLedger._finish, AdmissionGate.on_complete
 * and DeadlineGuard.on_complete, stream_answers.complete_answer, as the natives those end in
 * (completion_of, ledger_finish, deadline_complete, complete_answer) called one after the other.
 * The ~12 Python frames between them cost about what the natives do (a Complete in a hot loop:
 * 1.9 us through them, 1.1 in this pass). `plan` (GatewayCalls._complete_plan, read once a batch):
 * (new_completion, max_id_length, limits, ledger, registry, speculative, new_inflight, routing,
 * routing_size, guard | None, now). The caller vouches for what a batch cannot change: nothing
 * records completions, no admission queue waits, no routing policy hears its completions (its
 * on_complete is the base class's); this checks per Complete what one may change (another
 * replica's hook, a prefill hop charged, a policy built since the plan was read).
 *
 * NotImplemented, before anything changed, where the Python path does more (a prefill hop's
 * Complete, a session's end, replica sync, a charged hop) or decides otherwise (a Complete the
 * natives leave to their references, one not in flight: that path raises its NotFound); an
 * error as that path raises it. DeadlineGuard.on_complete's own fallback is kept: a guard
 * deadline_complete declines runs _complete_py. */
static PyObject *sc_on_completed_name, *sc_hops_charged_name, *sc_complete_py_name;

static PyObject *
stream_complete(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    enum { NEW_COMPLETION, MAX_ID, LIMITS, LEDGER, REGISTRY, SPECULATIVE, NEW_INFLIGHT, ROUTING, ROUTING_SIZE, GUARD,
           NOW, PLAN };
    if (nargs != 3 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != PLAN) {
        PyErr_SetString(PyExc_TypeError, "stream_complete(plan, item_id, msg): plan is GatewayCalls._complete_plan's");
        return NULL;
    }
    PyObject *const *plan = &PyTuple_GET_ITEM(args[0], 0);
    long long routing_size;
    if (!PyDict_CheckExact(plan[ROUTING]) || dl_long_arg(plan[ROUTING_SIZE], &routing_size)
        || PyDict_GET_SIZE(plan[ROUTING]) != routing_size)
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *of[] = {args[2], plan[NEW_COMPLETION], plan[MAX_ID], plan[LIMITS]};
    PyObject *completion = completion_of(module, of, 4);
    if (completion == NULL || completion == Py_NotImplemented)
        return completion;
    enum { ID = 0, TTFT = 1, E2E = 2, SUCCESS = 5, SESSION_ENDED = 6, PREFILL_DONE = 9 };
    static const int read[] = {ID, TTFT, E2E, SUCCESS, SESSION_ENDED, PREFILL_DONE};
    PyObject *v[10] = {NULL}, *hook = NULL, *charged = NULL, *released = NULL, *out = NULL;
    int r = 0;
    for (size_t i = 0; i < sizeof read / sizeof read[0] && r == 0; i++)
        if ((v[read[i]] = attr_get(completion, cp_names[read[i]])) == NULL)
            r = -1;
    if (r == 0 && ((hook = attr_get(plan[LEDGER], sc_on_completed_name)) == NULL
                   || (charged = attr_get(plan[LEDGER], sc_hops_charged_name)) == NULL))
        r = -1;
    if (r == 0 && (v[SESSION_ENDED] != Py_False || v[PREFILL_DONE] != Py_False || hook != Py_None || charged != Py_False))
        r = 1;
    if (r == 0) {
        PyObject *finish[] = {plan[LEDGER], plan[REGISTRY], v[ID], v[SUCCESS], plan[SPECULATIVE], plan[NEW_INFLIGHT]};
        if ((released = ledger_finish(module, finish, 6)) == NULL)
            r = -1;
        else if (released == Py_NotImplemented) /* nothing released: the Python path decides */
            r = 1;
    }
    /* released: the rest of _finish has nothing to do (no policy hears, no session ended) */
    if (r == 0 && plan[GUARD] != Py_None) {
        PyObject *now = PyObject_CallNoArgs(plan[NOW]);
        PyObject *learned = NULL;
        if (now != NULL) {
            PyObject *complete[] = {plan[GUARD], v[ID], v[TTFT], now, v[E2E]};
            learned = deadline_complete(module, complete, 5);
            if (learned == Py_NotImplemented) {
                Py_DECREF(learned);
                learned = PyObject_CallMethodObjArgs(plan[GUARD], sc_complete_py_name, v[ID], v[TTFT], now, v[E2E], NULL);
            }
        }
        r = learned == NULL ? -1 : 0;
        Py_XDECREF(learned);
        Py_XDECREF(now);
    }
    if (r == 0)
        out = complete_answer(module, args[1]);
    else if (r > 0)
        out = Py_NewRef(Py_NotImplemented);
    for (int i = 0; i < 10; i++)
        Py_XDECREF(v[i]);
    Py_XDECREF(hook);
    Py_XDECREF(charged);
    Py_XDECREF(released);
    Py_DECREF(completion);
    return out;
}

static PyMethodDef native_methods[] = {
    {"chain_keys", (PyCFunction)(void (*)(void))chain_keys, METH_FASTCALL,
     "chain_keys(data, block_size, seed, limit) -> list[int]: chained xxh3-64 keys of the full blocks."},
    {"chain_keys_array", (PyCFunction)(void (*)(void))chain_keys_array, METH_FASTCALL,
     "chain_keys_array(data, block_size, seed, limit) -> array('Q') of the block keys"},
    {"chain_keys_packed", (PyCFunction)(void (*)(void))chain_keys_packed, METH_FASTCALL,
     "chain_keys_packed(data, block_size, seed, limit) -> bytes: the keys as native-endian uint64s."},
    {"wire_prompt_keys", (PyCFunction)(void (*)(void))wire_prompt_keys, METH_FASTCALL,
     "wire_prompt_keys(data, spans, packed, block_size, seed, max_tokens) -> (tokens, keys bytes | None), "
     "the GIL released while decoding and hashing."},
    {"chain_split", (PyCFunction)(void (*)(void))chain_split, METH_FASTCALL,
     "chain_split(blocks, prio) -> (continued blocks whose key is in prio, blocks not continued)"},
    {"match_walk", (PyCFunction)(void (*)(void))match_walk, METH_FASTCALL,
     "match_walk(blocks, keys, slots_mask) -> (overlaps: Overlaps, path): each slot's longest prefix held, "
     "for masks of any width."},
    {"openai_prompt", (PyCFunction)(void (*)(void))openai_prompt, METH_FASTCALL,
     "openai_prompt(body, chat) -> (model_start, model_end, is_text, payload, length) | None: an OpenAI "
     "body's prompt read with the GIL released; None leaves the body to the Python parser."},
    {"prefix_scan", (PyCFunction)(void (*)(void))prefix_scan, METH_FASTCALL,
     "prefix_scan(candidates, overlaps, load_name, slots=None) -> (best_i, best_depth, min_i, min_load, max_load) "
     "| NotImplemented"},
    {"prefix_ties", (PyCFunction)(void (*)(void))prefix_ties, METH_FASTCALL,
     "prefix_ties(candidates, overlaps, load_name, start, depth, load, slots=None) -> [i, ...] | NotImplemented"},
    {"fewest_counted_at_load", (PyCFunction)(void (*)(void))fewest_counted_at_load, METH_FASTCALL,
     "fewest_counted_at_load(candidates, overlaps, load_name, start, load, counts, slots=None, slot_counts=None, "
     "slot_owners=None) -> i | NotImplemented: "
     "of the candidates from start at that load, the first whose id counts fewest"},
    {"dualmap_cold_pick", (PyCFunction)(void (*)(void))dualmap_cold_pick, METH_FASTCALL,
     "dualmap_cold_pick(candidates, slots, overlaps, claimed, prompt_tokens, block_size, now, backlog, rate, cost, "
     "slo_ms, threshold, stall) -> (first, second) | NotImplemented: DualMap's fleet-wide placement, its best two."},
    {"lbgr_pick", (PyCFunction)(void (*)(void))lbgr_pick, METH_FASTCALL,
     "lbgr_pick(candidates, slots, overlaps, prompt_tokens, block_size, loads, factor, per_hit, per_miss, "
     "load_unit_ms, features, learners, fleet_theta, low, high) -> (i, estimate_ms) | NotImplemented: LBGR's choice."},
    {"preble_pick", (PyCFunction)(void (*)(void))preble_pick, METH_FASTCALL,
     "preble_pick(candidates, slots, overlaps, claimed, prompt_tokens, block_size, now, backlog, rate, cost, "
     "hit_threshold) -> (i, load_cost_ms, best_hit, prefix_hit) | NotImplemented: Preble's choice."},
    {"min_ttft_pick", (PyCFunction)(void (*)(void))min_ttft_pick, METH_FASTCALL,
     "min_ttft_pick(candidates, slots, overlaps, claimed, prompt_tokens, block_size, now, backlog, rate, cost) -> "
     "(i, ttft_ms, pending_tokens) | NotImplemented: min_ttft's choice, priced from the loads by slot."},
    {"least_loaded_pick", (PyCFunction)(void (*)(void))least_loaded_pick, METH_FASTCALL,
     "least_loaded_pick(candidates, slots) -> i | NotImplemented: least_loaded's choice, the fewest pending prefill "
     "tokens, then in-flight requests, then reported queue, then the lowest slot, its loads read by slot"},
    {"named_among", (PyCFunction)(void (*)(void))named_among, METH_FASTCALL,
     "named_among(candidates, wanted) -> (named, mask) | NotImplemented: the candidates whose id is in the set "
     "wanted, in order, and their routing mask"},
    {"deadline_verdict", (PyCFunction)(void (*)(void))deadline_verdict, METH_FASTCALL,
     "deadline_verdict(candidates, overlaps, claimed, prompt_tokens, block_size, now, chosen_id, slo_ms, margin, "
     "levels, own_bare, own_by_tokens, prefill, backlog, anchored, anchor, queued, queue_ttft, kv) -> "
     "(predicted, best, budget, meets) | NotImplemented: DeadlineGuard._verdict_py's pass over the candidates"},
    {"deadline_constants", (PyCFunction)(void (*)(void))deadline_constants, METH_FASTCALL,
     "deadline_constants(scale_weight, log_scale_range, tail_step, margin_step, hold_weight, min_sample_ms, "
     "max_latency_ms, max_tracked, load_levels): deadline.py's, for the three passes below"},
    {"deadline_price", (PyCFunction)(void (*)(void))deadline_price, METH_FASTCALL,
     "deadline_price(guard, chosen, uncached, cached, now, slo_ms) -> Pricing | None | NotImplemented: "
     "DeadlineGuard._price_py with nothing queued"},
    {"deadline_dispatch", (PyCFunction)(void (*)(void))deadline_dispatch, METH_FASTCALL,
     "deadline_dispatch(guard, worker, request_id, uncached, now, cached, priced) -> None | NotImplemented: "
     "DeadlineGuard._dispatch_py"},
    {"deadline_complete", (PyCFunction)(void (*)(void))deadline_complete, METH_FASTCALL,
     "deadline_complete(guard, request_id, ttft_ms, now, e2e_ms) -> None | NotImplemented: DeadlineGuard._complete_py"},
    {"ledger_constants", (PyCFunction)(void (*)(void))ledger_constants, METH_FASTCALL,
     "ledger_constants(entry_bytes, candidate_bytes): ledger.py's, once at its import"},
    {"ledger_keep", (PyCFunction)(void (*)(void))ledger_keep, METH_FASTCALL,
     "ledger_keep(ledger, req) -> None | NotImplemented: LoadLedger._keep_py"},
    {"registry_charge", (PyCFunction)(void (*)(void))registry_charge, METH_FASTCALL,
     "registry_charge(registry, worker, request_id, prefill, prompt, overlap, started_at, policy) -> None | "
     "NotImplemented: WorkerRegistry._charge_py"},
    {"registry_release", (PyCFunction)(void (*)(void))registry_release, METH_FASTCALL,
     "registry_release(registry, request_id, new_inflight) -> InFlight | NotImplemented: WorkerRegistry._release_py"},
    {"ledger_commit", (PyCFunction)(void (*)(void))ledger_commit, METH_FASTCALL,
     "ledger_commit(ledger, decision, ctx, worker, registry, counters, none_claimed) -> None | NotImplemented: "
     "LoadLedger._commit_py"},
    {"ledger_finish", (PyCFunction)(void (*)(void))ledger_finish, METH_FASTCALL,
     "ledger_finish(ledger, registry, request_id, success, speculative, new_inflight) -> (InFlight, PackedRequest | None) "
     "| NotImplemented: LoadLedger._finish_py"},
    {"cache_aware_pick", (PyCFunction)(void (*)(void))cache_aware_pick, METH_FASTCALL,
     "cache_aware_pick(policy, ctx, overlap_rule, abs_threshold, rel_threshold, cache_threshold, load_name, "
     "new_decision, name) -> Decision | NotImplemented: CacheAwarePolicy._select_py, unexplained, KV triggers off"},
    {"ledger_request_id", (PyCFunction)(void (*)(void))ledger_request_id, METH_FASTCALL,
     "ledger_request_id(ledger, rng) -> str | NotImplemented: LoadLedger._new_request_id_py"},
    {"ledger_admissible", (PyCFunction)(void (*)(void))ledger_admissible, METH_FASTCALL,
     "ledger_admissible(ledger, req, max_inflight_per_client, max_inflight_bytes, max_id_length) -> bool: True when "
     "LoadLedger._check_admissible_py admits req without counting its bytes"},
    {"message_layouts", (PyCFunction)(void (*)(void))message_layouts, METH_FASTCALL,
     "message_layouts(route_request_class, complete_request_class) -> None: how route_request_packed and "
     "completion_of read those messages (None: by name)"},
    {"deadline_admit", (PyCFunction)(void (*)(void))deadline_admit, METH_FASTCALL,
     "deadline_admit(guard, ctx, chosen, request_id, slo_ms, none_claimed) -> Pricing | None | NotImplemented: "
     "DeadlineGuard._admit_py"},
    {"ledger_forget", (PyCFunction)(void (*)(void))ledger_forget, METH_FASTCALL,
     "ledger_forget(ledger, request_id) -> the packed request | None | NotImplemented: LoadLedger._forget_py"},
    {"route_check_constants", (PyCFunction)(void (*)(void))route_check_constants, METH_FASTCALL,
     "route_check_constants(max_ttft_slo_ms, max_output_tokens, max_workers, hop_prefix): selector.py's, at its import"},
    {"route_request_packed", (PyCFunction)(void (*)(void))route_request_packed, METH_FASTCALL,
     "route_request_packed(msg, new_request, tasks, adapter_bases, max_id_length, max_prompt_tokens, block_size, "
     "client) -> RouteRequest | NotImplemented: convert._route_request_py for a packed prompt"},
    {"route_answer", (PyCFunction)(void (*)(void))route_answer, METH_FASTCALL,
     "route_answer(item_id, result, block_size) -> bytes | NotImplemented: convert._route_answer_py"},
    {"complete_answer", (PyCFunction)complete_answer, METH_O,
     "complete_answer(item_id) -> bytes: convert._complete_answer_py"},
    {"stream_complete", (PyCFunction)(void (*)(void))stream_complete, METH_FASTCALL,
     "stream_complete(plan, item_id, msg) -> bytes | NotImplemented: a RouteStream batch's Complete applied and "
     "answered in one call (GatewayCalls._complete_plan)."},
    {"stream_batch_items", (PyCFunction)(void (*)(void))stream_batch_items, METH_FASTCALL,
     "stream_batch_items(data, max_items) -> list[(item_id, kind, fields)] | None: a RouteStreamRequest batch's "
     "items read from its bytes, or None for upb to parse it"},
    {"completion_of", (PyCFunction)(void (*)(void))completion_of, METH_FASTCALL,
     "completion_of(msg, new_completion, max_id_length, limits) -> Completion | NotImplemented: "
     "convert._completion_py for a Complete that passes its checks"},
    {"route_checked", (PyCFunction)(void (*)(void))route_checked, METH_FASTCALL,
     "route_checked(req, max_prompt_tokens, block_size, max_id_length) -> bool: Selector._validate_py passes it"},
    {"read_event_batch", (PyCFunction)(void (*)(void))read_event_batch, METH_FASTCALL,
     "read_event_batch(data, max_events, max_id_length, new_batch, new_stored, new_removed, new_cleared, max_blocks, "
     "block_size, event_blocks) -> "
     "an EventBatch message's core batch, or None for convert.event_batch to read it"},
    {"msgpack_uint32s", (PyCFunction)msgpack_uint32s, METH_O,
     "msgpack_uint32s(raw) -> bytes | None: a msgpack array of ints in [0, 2**32) as little-endian uint32 "
     "bytes, else None"},
    {"set_event_types", (PyCFunction)(void (*)(void))set_event_types, METH_FASTCALL,
     "set_event_types(Stored, Removed, Cleared): the core event classes events_plain and BlockTable.store_events read"},
    {"events_plain", (PyCFunction)(void (*)(void))events_plain, METH_FASTCALL,
     "events_plain(events, page, block_size, max_groups) -> bool: every event passes EventApplier's check as it is"},
    {"touch_pending", (PyCFunction)(void (*)(void))touch_pending, METH_FASTCALL,
     "touch_pending(pending, slot, node, now) -> None | NotImplemented: RadixIndex._touch_py"},
    {"set_leaf_recency", (PyCFunction)set_leaf_recency, METH_O,
     "set_leaf_recency(fn): fn is RadixIndex.recency, which LeafOrder.stored then computes itself where it can"},
    {"u64_array", (PyCFunction)u64_array, METH_O,
     "u64_array(values) -> array('Q') | None: array('Q', values) for a tuple or list of ints, else None"},
    {"slots_filler", (PyCFunction)(void (*)(void))slots_filler, METH_FASTCALL,
     "slots_filler(cls, names) -> filler: filler(*values) is cls(*values) for a class whose __init__ only stores them"},
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
    pending_name = PyUnicode_InternFromString("_pending");
    slot_name = PyUnicode_InternFromString("slot");
    slot_loads_name = PyUnicode_InternFromString("slot_loads");
    id_name = PyUnicode_InternFromString("id");
    reported_running_name = PyUnicode_InternFromString("reported_running");
    reported_at_name = PyUnicode_InternFromString("reported_at");
    inflight_requests_name = PyUnicode_InternFromString("inflight_requests");
    spec_name = PyUnicode_InternFromString("spec");
    kv_utilization_name = PyUnicode_InternFromString("kv_utilization");
    capacity_blocks_name = PyUnicode_InternFromString("capacity_blocks");
    block_size_name = PyUnicode_InternFromString("block_size");
    values_name = PyUnicode_InternFromString("values");
    dl_levels_name = PyUnicode_InternFromString("_levels");
    dl_margin_name = PyUnicode_InternFromString("_margin");
    dl_anchored_name = PyUnicode_InternFromString("_anchored");
    dl_backlog_name = PyUnicode_InternFromString("_backlog");
    dl_hold_ms_name = PyUnicode_InternFromString("hold_ms");
    dl_hold_sq_name = PyUnicode_InternFromString("_hold_sq_ms");
    dl_waiting_tokens_name = PyUnicode_InternFromString("_waiting_tokens");
    dl_waiting_count_name = PyUnicode_InternFromString("_waiting_count");
    dl_flight_name = PyUnicode_InternFromString("_flight");
    dl_last_prefill_name = PyUnicode_InternFromString("_last_prefill");
    dl_prefill_ms_name = PyUnicode_InternFromString("prefill_ms");
    dl_anchor_name = PyUnicode_InternFromString("_anchor");
    dl_predicted_name = PyUnicode_InternFromString("_predicted");
    dl_where_name = PyUnicode_InternFromString("_where");
    dl_forget_name = PyUnicode_InternFromString("_forget");
    dl_judged_name = PyUnicode_InternFromString("_judged");
    dl_quantile_name = PyUnicode_InternFromString("quantile");
    dl_log_margin_name = PyUnicode_InternFromString("_log_margin");
    dl_samples_name = PyUnicode_InternFromString("_samples");
    dl_scales_name = PyUnicode_InternFromString("_scales");
    dl_tails_name = PyUnicode_InternFromString("_tails");
    dl_popitem_name = PyUnicode_InternFromString("popitem");
    pending_prefill_tokens_name = PyUnicode_InternFromString("pending_prefill_tokens");
    reported_queue_name = PyUnicode_InternFromString("reported_queue");
    queued_prefill_tokens_name = PyUnicode_InternFromString("queued_prefill_tokens");
    queued_requests_name = PyUnicode_InternFromString("queued_requests");
    theta_name = PyUnicode_InternFromString("theta");
    if (pending_prefill_tokens_name == NULL || reported_queue_name == NULL || queued_prefill_tokens_name == NULL
        || queued_requests_name == NULL || theta_name == NULL)
        return NULL;
    PyObject *dl_names[] = {dl_levels_name, dl_margin_name, dl_anchored_name, dl_backlog_name, dl_hold_ms_name,
                            dl_hold_sq_name, dl_waiting_tokens_name, dl_waiting_count_name, dl_flight_name,
                            dl_last_prefill_name, dl_prefill_ms_name, dl_anchor_name, dl_predicted_name, dl_where_name,
                            dl_forget_name, dl_judged_name, dl_quantile_name, dl_log_margin_name, dl_samples_name,
                            dl_scales_name, dl_tails_name, dl_popitem_name};
    for (size_t i = 0; i < sizeof dl_names / sizeof dl_names[0]; i++)
        if (dl_names[i] == NULL)
            return NULL;
    if (reported_running_name == NULL || reported_at_name == NULL || inflight_requests_name == NULL || spec_name == NULL
        || kv_utilization_name == NULL || capacity_blocks_name == NULL || block_size_name == NULL || values_name == NULL)
        return NULL;
    la_waiting_bytes_name = PyUnicode_InternFromString("waiting_bytes");
    if (la_waiting_bytes_name == NULL)
        return NULL;
    list_fields_name = PyUnicode_InternFromString("ListFields");
    descriptor_name = PyUnicode_InternFromString("DESCRIPTOR");
    fields_by_name_name = PyUnicode_InternFromString("fields_by_name");
    if (list_fields_name == NULL || descriptor_name == NULL || fields_by_name_name == NULL)
        return NULL;
    da_overlaps_name = PyUnicode_InternFromString("_overlaps");
    da_claimed_name = PyUnicode_InternFromString("claimed");
    da_request_name = PyUnicode_InternFromString("request");
    da_now_name = PyUnicode_InternFromString("now");
    if (da_overlaps_name == NULL || da_claimed_name == NULL || da_request_name == NULL || da_now_name == NULL)
        return NULL;
    /* the commit's, the finish's, the request id's and cache_aware's pick's names */
    static const struct {
        PyObject **name;
        const char *text;
    } pass_names[] = {
        {&lc_prefix_hits_name, "prefix_hits"}, {&lc_by_policy_name, "decisions_by_policy"},
        {&lc_overlap_blocks_name, "overlap_blocks"}, {&lc_prefill_name, "prefill"}, {&lc_match_name, "match"},
        {&lc_path_name, "path"}, {&lc_decisions_key, "decisions"}, {&lc_keep_py_name, "_keep_py"},
        {&lf_by_request_name, "_by_request"}, {&lf_ended_name, "ended"}, {&lf_forget_py_name, "_forget_py"},
        {&ca_candidates_name, "candidates"}, {&ca_slots_name, "candidate_slots"}, {&ca_index_name, "index"},
        {&ca_counts_name, "counts"}, {&ca_processed_name, "_processed"}, {&ca_by_slot_name, "_processed_by_slot"},
        {&ca_owner_name, "_processed_owner"}, {&ca_chosen_name, "_chosen"},
        {&lc_hit_names[LC_BEST], "best"}, {&lc_hit_names[LC_WORSE], "worse"}, {&lc_hit_names[LC_NO_PREFIX], "no_prefix"},
        {&lc_hit_names[LC_ACHIEVED], "achieved_blocks"}, {&lc_hit_names[LC_REACHABLE], "reachable_blocks"},
        {&ca_reasons[CA_IMBALANCED], "imbalanced"}, {&ca_reasons[CA_PREFIX_MATCH], "prefix_match"},
        {&ca_reasons[CA_NO_OVERLAP], "no_overlap"}, {&ca_reasons[CA_LOW_MATCH], "low_match"},
        {&lr_counter_name, "_request_counter"}, {&lr_getrandbits_name, "getrandbits"},
        {&sc_on_completed_name, "on_completed"}, {&sc_hops_charged_name, "_hops_charged"},
        {&sc_complete_py_name, "_complete_py"},
    };
    for (size_t i = 0; i < sizeof pass_names / sizeof pass_names[0]; i++)
        if ((*pass_names[i].name = PyUnicode_InternFromString(pass_names[i].text)) == NULL)
            return NULL;
    if ((lr_bits = PyLong_FromLong(32)) == NULL)
        return NULL;
    wr_inflight_name = PyUnicode_InternFromString("_inflight");
    wr_order_name = PyUnicode_InternFromString("_inflight_order");
    wr_workers_name = PyUnicode_InternFromString("_workers");
    wr_append_name = PyUnicode_InternFromString("append");
    if (wr_inflight_name == NULL || wr_order_name == NULL || wr_workers_name == NULL || wr_append_name == NULL)
        return NULL;
    PyObject *collections = PyImport_ImportModule("collections");
    if (collections == NULL)
        return NULL;
    wr_deque_type = (PyTypeObject *)PyObject_GetAttrString(collections, "deque");
    Py_DECREF(collections);
    if (wr_deque_type == NULL || !PyType_Check(wr_deque_type))
        return NULL;
    lg_requests_name = PyUnicode_InternFromString("requests");
    lg_by_client_name = PyUnicode_InternFromString("by_client");
    lg_inflight_bytes_name = PyUnicode_InternFromString("inflight_bytes");
    lg_request_id_name = PyUnicode_InternFromString("request_id");
    lg_keys_name = PyUnicode_InternFromString("keys");
    lg_prompt_tokens_name = PyUnicode_InternFromString("prompt_tokens");
    lg_session_id_name = PyUnicode_InternFromString("session_id");
    lg_task_name = PyUnicode_InternFromString("task");
    lg_ttft_slo_ms_name = PyUnicode_InternFromString("ttft_slo_ms");
    lg_output_name = PyUnicode_InternFromString("expected_output_tokens");
    lg_policy_name = PyUnicode_InternFromString("policy");
    lg_candidates_name = PyUnicode_InternFromString("candidate_workers");
    lg_model_name = PyUnicode_InternFromString("model");
    lg_lora_name = PyUnicode_InternFromString("lora");
    lg_client_name = PyUnicode_InternFromString("client");
    static const char *const completion_fields[] = {"request_id", "ttft_ms", "e2e_ms", "cached_tokens",
                                                    "output_tokens", "success", "session_ended", "prefill_ms",
                                                    "kv_transfer_ms", "prefill_done"};
    for (int i = 0; i < 10; i++)
        if ((cp_names[i] = PyUnicode_InternFromString(completion_fields[i])) == NULL)
            return NULL;
    static const char *const answer_result[] = {"request", "decision", "worker", "alternative"},
                             *const answer_request[] = {"request_id", "keys"},
                             *const answer_decision[] = {"overlap_blocks", "policy", "reason", "estimated_ttft_ms",
                                                         "pd_reason"};
    for (int i = 0; i < 4; i++)
        if ((ra_result_names[i] = PyUnicode_InternFromString(answer_result[i])) == NULL)
            return NULL;
    for (int i = 0; i < 2; i++)
        if ((ra_request_names[i] = PyUnicode_InternFromString(answer_request[i])) == NULL)
            return NULL;
    for (int i = 0; i < 5; i++)
        if ((ra_decision_names[i] = PyUnicode_InternFromString(answer_decision[i])) == NULL)
            return NULL;
    if ((ra_address_name = PyUnicode_InternFromString("address")) == NULL)
        return NULL;
    sb_kind_route = PyUnicode_InternFromString("route");
    sb_kind_complete = PyUnicode_InternFromString("complete");
    PyObject *no_text = PyUnicode_New(0, 0), *no_number = PyLong_FromLong(0), *no_ms = PyFloat_FromDouble(0.0);
    PyObject *no_bytes = PyBytes_FromStringAndSize(NULL, 0), *none_repeated = PyTuple_New(0);
    if (sb_kind_route == NULL || sb_kind_complete == NULL || no_text == NULL || no_number == NULL || no_ms == NULL
        || no_bytes == NULL || none_repeated == NULL)
        return NULL;
    PyObject *const route_defaults[RR_N] = {no_bytes, none_repeated, none_repeated, no_number, no_text, no_text,
                                            no_text, no_text, no_text, no_ms, no_number, no_text, NULL};
    PyObject *const complete_defaults[10] = {no_text, no_ms, no_ms, no_number, no_number, Py_False, Py_False, no_ms,
                                             no_ms, Py_False};
    for (int i = 0; i < RR_N; i++) /* kept for the process's life, as the interned names */
        sb_route_defaults[i] = Py_XNewRef(route_defaults[i]);
    for (int i = 0; i < 10; i++)
        sb_complete_defaults[i] = Py_NewRef(complete_defaults[i]);
    Py_DECREF(no_text);
    Py_DECREF(no_number);
    Py_DECREF(no_ms);
    Py_DECREF(no_bytes);
    Py_DECREF(none_repeated);
    rr_token_ids_name = PyUnicode_InternFromString("token_ids");
    rr_block_keys_name = PyUnicode_InternFromString("block_keys");
    rr_le32_name = PyUnicode_InternFromString("token_ids_le32");
    rr_cache_salt_name = PyUnicode_InternFromString("cache_salt");
    if (rr_token_ids_name == NULL || rr_block_keys_name == NULL || rr_le32_name == NULL || rr_cache_salt_name == NULL)
        return NULL;
    PyObject *lg_names[] = {lg_requests_name, lg_by_client_name, lg_inflight_bytes_name, lg_request_id_name, lg_keys_name, lg_prompt_tokens_name, lg_session_id_name, lg_task_name, lg_ttft_slo_ms_name, lg_output_name, lg_policy_name, lg_candidates_name, lg_model_name, lg_lora_name, lg_client_name};
    for (size_t i = 0; i < sizeof lg_names / sizeof lg_names[0]; i++)
        if (lg_names[i] == NULL)
            return NULL;
    float_zero = PyFloat_FromDouble(0.0);
    empty_str = PyUnicode_FromString("");
    zero = PyLong_FromLong(0);
    one = PyLong_FromLong(1);
    minus_one = PyLong_FromLong(-1);
    PyObject *array_module = PyImport_ImportModule("array");
    if (array_module == NULL)
        return NULL;
    array_q_zero = PyObject_CallMethod(array_module, "array", "s[i]", "Q", 0);
    Py_DECREF(array_module);
    if (array_q_zero == NULL || minus_one == NULL || holders_name == NULL || pending_name == NULL || slot_name == NULL || slot_loads_name == NULL || id_name == NULL || float_zero == NULL || empty_str == NULL || zero == NULL || one == NULL || PyType_Ready(&U64MapType) < 0
        || PyType_Ready(&BlockStateType) < 0 || PyType_Ready(&BlockType) < 0 || PyType_Ready(&BlockTableType) < 0
        || PyType_Ready(&SlotsFillerType) < 0 || PyType_Ready(&OverlapsType) < 0 || PyType_Ready(&LeafOrderType) < 0 || PyType_Ready(&LeafOrderIterType) < 0
        || PyType_Ready(&SlotLoadsType) < 0 || PyType_Ready(&SlotLoadType) < 0
        || PyType_Ready(&CandidateSlotsType) < 0)
        return NULL;
    state_zero = state_new(zero, float_zero, zero);
    if (state_zero == NULL)
        return NULL;
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL)
        return NULL;
    /* old slots a growing table empties per insert or delete: the tests' bound on a call's work */
    if (PyModule_AddIntConstant(module, "MIGRATE_SLOTS", MIGRATE_SLOTS) < 0
        || PyModule_AddObjectRef(module, "U64Map", (PyObject *)&U64MapType) < 0
        || PyModule_AddObjectRef(module, "Block", (PyObject *)&BlockType) < 0
        || PyModule_AddObjectRef(module, "BlockTable", (PyObject *)&BlockTableType) < 0
        || PyModule_AddObjectRef(module, "LeafOrder", (PyObject *)&LeafOrderType) < 0
        || PyModule_AddObjectRef(module, "Overlaps", (PyObject *)&OverlapsType) < 0
        || PyModule_AddObjectRef(module, "SlotLoads", (PyObject *)&SlotLoadsType) < 0
        || PyModule_AddObjectRef(module, "SlotLoad", (PyObject *)&SlotLoadType) < 0
        || PyModule_AddObjectRef(module, "CandidateSlots", (PyObject *)&CandidateSlotsType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
