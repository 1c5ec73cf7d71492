/* C smoke test of the csa2 ABI: compiled against include/csa2.h and linked to libcsa2.so by
 * tests/c_smoke.rs. Exercises error paths (null pointers, bad JSON, wrong lengths, bad enum
 * values, a too-small error buffer), an encode/decode round trip and indexed attention against a
 * double evaluation. Exit 0 = pass. */
#include "csa2.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond, ...)                                                  \
    do {                                                                  \
        if (!(cond)) {                                                    \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);          \
            fprintf(stderr, __VA_ARGS__);                                 \
            fprintf(stderr, "\n");                                        \
            failures++;                                                   \
        }                                                                 \
    } while (0)

/* An args struct as the header asks: zero-initialised, struct_size set, then the named members. */
#define ARGS(T, ...) (&(T){.struct_size = sizeof(T), __VA_ARGS__})

static const char *last_error(void) {
    static char buf[1024];
    size_t need = csa2_last_error_message(buf, sizeof buf);
    return need ? buf : "";
}

static void expect_status(Csa2Status got, Csa2Status want, const char *needle, const char *what) {
    CHECK(got == want, "%s: status %d, want %d (%s)", what, (int)got, (int)want, last_error());
    if (needle) {
        CHECK(strstr(last_error(), needle) != NULL, "%s: last error \"%s\" lacks \"%s\"", what,
              last_error(), needle);
    }
}

static DLTensor tensor(void *data, int ndim, int64_t *shape, uint8_t code, uint8_t bits) {
    DLTensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.device.device_type = kDLCPU;
    t.ndim = ndim;
    t.dtype.code = code;
    t.dtype.bits = bits;
    t.dtype.lanes = 1;
    t.shape = shape;
    return t;
}

int main(void) {
    const char *v = csa2_version();
    CHECK(v != NULL && strlen(v) >= 5, "version");
    printf("csa2 %s\n", v);

    /* --- geometry ------------------------------------------------------------------------ */
    Csa2Geometry *g = NULL;
    expect_status(csa2_geometry_embedded(NULL), CSA2_ERR_NULL_POINTER, "out", "embedded(NULL)");
    expect_status(csa2_geometry_embedded(&g), CSA2_OK, NULL, "embedded");
    CHECK(g != NULL, "embedded handle");
    CHECK(csa2_last_error_message(NULL, 0) == 0, "no error after success");

    size_t n = 0;
    expect_status(csa2_geometry_num_layers(g, &n), CSA2_OK, NULL, "num_layers");
    CHECK(n == 40, "num_layers = %zu", n);
    expect_status(csa2_geometry_num_layers(NULL, &n), CSA2_ERR_NULL_POINTER, "geometry", "num_layers(NULL)");

    Csa2LayerInfo li;
    expect_status(csa2_geometry_layer(g, 0, &li), CSA2_OK, NULL, "layer 0");
    CHECK(li.role == CSA2_ROLE_SWA_ONLY && li.kv_source == -1 && li.index_source == -1, "layer 0 plan");
    expect_status(csa2_geometry_layer(g, 27, &li), CSA2_OK, NULL, "layer 27");
    CHECK(li.role == CSA2_ROLE_REUSE && li.ratio == 1 && li.kv_source == 20 && li.index_source == 24 &&
              li.encoder == 0,
          "layer 27 plan: role %d ratio %u kv %d idx %d", (int)li.role, li.ratio, li.kv_source,
          li.index_source);
    expect_status(csa2_geometry_layer(g, 2, &li), CSA2_OK, NULL, "layer 2");
    CHECK(li.role == CSA2_ROLE_FULL && li.ratio == 2 && li.encoder == 1, "layer 2 plan");
    expect_status(csa2_geometry_layer(g, 40, &li), CSA2_ERR_INVALID_ARGUMENT, "out of range", "layer 40");

    double bpt = 0;
    expect_status(csa2_geometry_global_kv_bytes_per_token(g, CSA2_LAYOUT_NVFP4, &bpt), CSA2_OK, NULL, "bytes");
    CHECK(bpt == 890.0, "890 B/token, got %f", bpt);
    expect_status(csa2_geometry_global_kv_bytes_per_token(g, CSA2_LAYOUT_V4, &bpt), CSA2_OK, NULL, "bytes v4");
    CHECK(bpt == 1790.0, "v4 1790 B/token, got %f", bpt);
    expect_status(csa2_geometry_global_kv_bytes_per_token(g, 7, &bpt), CSA2_ERR_INVALID_ARGUMENT, "layout",
                  "bad layout");
    uint64_t swa = 0;
    expect_status(csa2_geometry_swa_bytes_per_request(g, CSA2_LAYOUT_NVFP4, &swa), CSA2_OK, NULL, "swa");
    CHECK(swa == 40u * 128u * 528u, "swa bytes %llu", (unsigned long long)swa);
    csa2_geometry_free(g);
    csa2_geometry_free(NULL);

    Csa2Geometry *bad = NULL;
    const char *junk = "{\"text_config\": {";
    expect_status(csa2_geometry_from_json(junk, strlen(junk), &bad), CSA2_ERR_CONFIG_JSON, "JSON", "bad JSON");
    CHECK(bad == NULL, "no handle on error");
    (void)csa2_version(); /* a query that cannot fail keeps the last error */
    CHECK(strstr(last_error(), "JSON") != NULL, "last error survives csa2_version");
    const char *missing = "{\"hidden_size\": 5120}";
    expect_status(csa2_geometry_from_json(missing, strlen(missing), &bad), CSA2_ERR_CONFIG_MISSING,
                  "num_hidden_layers", "missing field");
    expect_status(csa2_geometry_from_json(NULL, 10, &bad), CSA2_ERR_NULL_POINTER, "json", "null json");

    /* The error message fits truncated into a tiny buffer, NUL-terminated. */
    char tiny[8];
    memset(tiny, 'x', sizeof tiny);
    size_t need = csa2_last_error_message(tiny, sizeof tiny);
    CHECK(need > sizeof tiny && tiny[sizeof tiny - 1] == '\0' && strlen(tiny) == sizeof tiny - 1,
          "truncation: need %zu", need);

    /* --- codecs --------------------------------------------------------------------------- */
    Csa2FormatInfo fi;
    expect_status(csa2_format_info(CSA2_FORMAT_NVFP4, &fi), CSA2_OK, NULL, "format info");
    CHECK(fi.dim == 512 && fi.record_bytes == 288 && fi.data_bytes == 256 && fi.scale_bytes == 32, "nvfp4 info");
    expect_status(csa2_format_info(-1, &fi), CSA2_ERR_INVALID_ARGUMENT, "format", "bad format");

    enum { ROWS = 3, DIM = 512 };
    float *x = malloc(sizeof(float) * ROWS * DIM);
    float *y = malloc(sizeof(float) * ROWS * DIM);
    uint8_t *rec = malloc(288 * ROWS);
    for (int i = 0; i < ROWS * DIM; i++) x[i] = sinf(0.37f * (float)i) * (float)(1 + i % 7);
    expect_status(csa2_encode_rows(CSA2_FORMAT_NVFP4, x, ROWS * DIM, rec, 288 * ROWS), CSA2_OK, NULL, "encode");
    expect_status(csa2_decode_rows(CSA2_FORMAT_NVFP4, rec, 288 * ROWS, y, ROWS * DIM), CSA2_OK, NULL, "decode");
    double err = 0, norm = 0;
    for (int i = 0; i < ROWS * DIM; i++) {
        err += (x[i] - y[i]) * (x[i] - y[i]);
        norm += x[i] * x[i];
    }
    CHECK(err / norm < 0.02, "round trip relative error %g", err / norm);

    /* wrong lengths and null buffers */
    expect_status(csa2_encode_rows(CSA2_FORMAT_NVFP4, x, ROWS * DIM - 1, rec, 288 * ROWS), CSA2_ERR_SHAPE,
                  "multiple of 512", "encode partial row");
    expect_status(csa2_encode_rows(CSA2_FORMAT_NVFP4, x, ROWS * DIM, rec, 288 * ROWS - 1), CSA2_ERR_SHAPE,
                  "record buffer", "encode short out");
    expect_status(csa2_decode_rows(CSA2_FORMAT_NVFP4, rec, 288 * ROWS, y, 7), CSA2_ERR_SHAPE, NULL, "decode short");
    expect_status(csa2_encode_rows(CSA2_FORMAT_NVFP4, NULL, 512, rec, 288), CSA2_ERR_NULL_POINTER, "x", "null x");
    expect_status(csa2_decode_rows(CSA2_FORMAT_MXFP8, rec, 288, NULL, 512), CSA2_ERR_NULL_POINTER, "out",
                  "null out");
    expect_status(csa2_encode_rows(CSA2_FORMAT_NVFP4, (const float *)((const char *)x + 1), 512, rec, 288),
                  CSA2_ERR_INVALID_ARGUMENT, "aligned", "misaligned x");

    /* pages: rows 0 and 2 into slots 5 and 0 of a 2-page pool of 4 slots, row 1 skipped */
    uint8_t *pool = calloc(2 * 4 * 288, 1);
    int64_t map[ROWS] = {5, -1, 0};
    expect_status(csa2_encode_into_pages(ARGS(Csa2EncodeIntoPagesArgs, .format_id = CSA2_FORMAT_NVFP4, .slots_per_page = 4, .x = x, .slot_mapping = map, .n_rows = ROWS, .pool = pool, .pool_len = 2 * 4 * 288)), CSA2_OK, NULL,
                  "pages");
    /* slot 5 = page 1, offset 1: data at 4*288 + 1*256, scales at 4*288 + 4*256 + 1*32 */
    CHECK(memcmp(pool + 4 * 288 + 256, rec, 256) == 0, "page data of slot 5");
    CHECK(memcmp(pool + 4 * 288 + 4 * 256 + 32, rec + 256, 32) == 0, "page scales of slot 5");
    CHECK(memcmp(pool, rec + 2 * 288, 256) == 0, "page data of slot 0");
    /* A struct_size below the first version (a caller that never set it) is refused, naming the
     * struct; a null args pointer is a null-pointer error. */
    Csa2EncodeIntoPagesArgs unsized = {0};
    expect_status(csa2_encode_into_pages(&unsized), CSA2_ERR_INVALID_ARGUMENT, "Csa2EncodeIntoPagesArgs",
                  "struct_size 0");
    expect_status(csa2_encode_into_pages(NULL), CSA2_ERR_NULL_POINTER, "Csa2EncodeIntoPagesArgs", "null args");
    int64_t dup[ROWS] = {1, 1, -1};
    expect_status(csa2_encode_into_pages(ARGS(Csa2EncodeIntoPagesArgs, .format_id = CSA2_FORMAT_NVFP4, .slots_per_page = 4, .x = x, .slot_mapping = dup, .n_rows = ROWS, .pool = pool, .pool_len = 2 * 4 * 288)),
                  CSA2_ERR_INVALID_ARGUMENT, "slot 1", "duplicate slot");
    int64_t far[ROWS] = {8, -1, -1};
    expect_status(csa2_encode_into_pages(ARGS(Csa2EncodeIntoPagesArgs, .format_id = CSA2_FORMAT_NVFP4, .slots_per_page = 4, .x = x, .slot_mapping = far, .n_rows = ROWS, .pool = pool, .pool_len = 2 * 4 * 288)),
                  CSA2_ERR_INVALID_ARGUMENT, "slot_mapping", "slot out of range");

    /* --- KV cache manager and replay planner ------------------------------------------------ */
    Csa2Geometry *cg = NULL;
    expect_status(csa2_geometry_embedded(&cg), CSA2_OK, NULL, "embedded for cache");
    Csa2Cache *cache = NULL;
    expect_status(csa2_cache_create(ARGS(Csa2CacheCreateArgs, .geometry = cg, .layout = CSA2_LAYOUT_NVFP4, .num_blocks = 0, .block_tokens = 256, .model = NULL, .model_len = 0), &cache), CSA2_ERR_INVALID_ARGUMENT,
                  "num_blocks", "cache 0 blocks");
    CHECK(cache == NULL, "no cache handle on error");
    expect_status(csa2_cache_create(ARGS(Csa2CacheCreateArgs, .geometry = cg, .layout = CSA2_LAYOUT_NVFP4, .num_blocks = 3, .block_tokens = 256, .model = NULL, .model_len = 0), &cache), CSA2_OK, NULL, "cache");
    expect_status(csa2_cache_allocate(cache, 42, 10), CSA2_ERR_NOT_FOUND, "request 42", "unknown request");
    expect_status(csa2_cache_add_request(cache, 42), CSA2_OK, NULL, "add request");
    expect_status(csa2_cache_allocate(cache, 42, 513), CSA2_OK, NULL, "allocate 513 tokens");
    size_t nt = 0;
    expect_status(csa2_cache_block_table(cache, 42, NULL, 0, &nt), CSA2_OK, NULL, "table size");
    CHECK(nt == 3, "table length %zu", nt);
    uint32_t table[3] = {0};
    expect_status(csa2_cache_block_table(cache, 42, table, 2, &nt), CSA2_ERR_INVALID_ARGUMENT, "needs 3",
                  "table cap too small");
    expect_status(csa2_cache_block_table(cache, 42, table, 3, &nt), CSA2_OK, NULL, "table");
    CHECK(table[0] == 0 && table[1] == 1 && table[2] == 2, "table %u %u %u", table[0], table[1], table[2]);
    int64_t slots[4] = {0};
    /* layer 2 is a ratio-2 KV source: 128 entries per 256-token block */
    expect_status(csa2_cache_slot_mapping(cache, 42, 2, 126, 4, slots), CSA2_OK, NULL, "slot mapping");
    CHECK(slots[0] == 126 && slots[2] == 128 && slots[3] == 129, "slots %lld %lld", (long long)slots[0],
          (long long)slots[3]);
    expect_status(csa2_cache_slot_mapping(cache, 42, 0, 0, 1, slots), CSA2_ERR_INVALID_ARGUMENT, "layer",
                  "slot mapping of an SWA layer");
    expect_status(csa2_cache_add_request(cache, 43), CSA2_OK, NULL, "add request 43");
    expect_status(csa2_cache_allocate(cache, 43, 1), CSA2_ERR_OUT_OF_BLOCKS, NULL, "out of blocks");
    Csa2CacheStats cst;
    expect_status(csa2_cache_stats(cache, &cst), CSA2_OK, NULL, "stats");
    CHECK(cst.total_blocks == 3 && cst.used_blocks == 3 && cst.requests == 2 &&
              cst.in_use_bytes == 3 * cst.slab_bytes && cst.slab_bytes > 0,
          "stats: %llu used of %llu", (unsigned long long)cst.used_blocks, (unsigned long long)cst.total_blocks);
    Csa2RequestBytes rb;
    expect_status(csa2_cache_request_bytes(cache, 42, &rb), CSA2_OK, NULL, "request bytes");
    CHECK(rb.tokens == 513 && rb.blocks == 3 && rb.slab_bytes == 3 * cst.slab_bytes, "request bytes");
    expect_status(csa2_cache_free_request(cache, 42), CSA2_OK, NULL, "free request");
    expect_status(csa2_cache_free_request(cache, 42), CSA2_ERR_NOT_FOUND, NULL, "double free");
    expect_status(csa2_cache_allocate(cache, 43, 1), CSA2_OK, NULL, "allocate after free");
    /* Handle misuse is refused, never undefined behaviour: a geometry passed as a cache, a
     * garbage value, then use after free and double free. */
    expect_status(csa2_cache_add_request((const Csa2Cache *)cg, 1), CSA2_ERR_INVALID_HANDLE,
                  "Csa2Geometry", "geometry as cache");
    expect_status(csa2_cache_add_request((const Csa2Cache *)(uintptr_t)0xdeadbeef, 1),
                  CSA2_ERR_INVALID_HANDLE, "garbage", "garbage handle");
    expect_status(csa2_cache_free(cache), CSA2_OK, NULL, "cache free");
    expect_status(csa2_cache_add_request(cache, 1), CSA2_ERR_INVALID_HANDLE, "freed", "use after free");
    expect_status(csa2_cache_free(cache), CSA2_ERR_INVALID_HANDLE, "freed", "double free");
    expect_status(csa2_cache_free(NULL), CSA2_OK, NULL, "free(NULL)");

    /* --- record-level cache access, stateful compressor, candidate-restricted indexer ------ */
    {
        Csa2Cache *rc = NULL;
        expect_status(csa2_cache_create(ARGS(Csa2CacheCreateArgs, .geometry = cg, .layout = CSA2_LAYOUT_NVFP4, .num_blocks = 4, .block_tokens = 256, .model = NULL, .model_len = 0), &rc), CSA2_OK, NULL, "rec cache");
        Csa2CacheLayerInfo ci;
        expect_status(csa2_cache_layer_info(rc, 2, &ci), CSA2_OK, NULL, "layer info");
        CHECK(ci.kv_source == 1 && ci.ratio == 2 && ci.main_record_bytes == 288 && ci.entries_per_block == 128 &&
                  ci.compressor_state_floats == 1024,
              "layer 2 info");
        expect_status(csa2_cache_add_request(rc, 1), CSA2_OK, NULL, "rec add");
        expect_status(csa2_cache_allocate(rc, 1, 512), CSA2_OK, NULL, "rec allocate");
        /* rows 0 and 2 of x into entries 127 and 128 (two blocks) of layer 2's main KV */
        int64_t ent[2] = {127, 128}, ent_shape[1] = {2}, row_shape[2] = {2, 512}, rec_shape[2] = {2, 288};
        float rows[2 * 512];
        memcpy(rows, x, sizeof(float) * 512);
        memcpy(rows + 512, x + 2 * 512, sizeof(float) * 512);
        DLTensor te = tensor(ent, 1, ent_shape, kDLInt, 64);
        DLTensor tr = tensor(rows, 2, row_shape, kDLFloat, 32);
        expect_status(csa2_cache_write_entries(rc, 1, 2, CSA2_RECORD_MAIN, &te, &tr), CSA2_OK, NULL, "write entries");
        uint8_t back[2 * 288];
        DLTensor tb = tensor(back, 2, rec_shape, kDLUInt, 8);
        expect_status(csa2_cache_read_entries(rc, 1, 2, CSA2_RECORD_MAIN, &te, &tb), CSA2_OK, NULL, "read entries");
        CHECK(memcmp(back, rec, 288) == 0 && memcmp(back + 288, rec + 2 * 288, 288) == 0,
              "entries hold the codec's records");
        expect_status(csa2_cache_write_entries(rc, 9, 2, CSA2_RECORD_MAIN, &te, &tr), CSA2_ERR_NOT_FOUND, "request 9",
                      "write unknown request");
        expect_status(csa2_cache_write_entries(rc, 1, 0, CSA2_RECORD_MAIN, &te, &tr), CSA2_ERR_INVALID_ARGUMENT,
                      "layer 0", "write SWA-only layer");
        DLTensor dev = tr;
        dev.device.device_type = kDLCUDA;
        expect_status(csa2_cache_write_entries(rc, 1, 2, CSA2_RECORD_MAIN, &te, &dev), CSA2_ERR_UNSUPPORTED, "CUDA",
                      "write device tensor");
        /* publish block 0: entry 127 becomes read-only, and the batch writes nothing */
        uint32_t toks[256];
        for (int i = 0; i < 256; i++) toks[i] = (uint32_t)i;
        uint8_t key[32];
        size_t nk = 0;
        expect_status(csa2_cache_prefix_keys(rc, toks, 256, key, 1, &nk), CSA2_OK, NULL, "keys");
        expect_status(csa2_cache_publish(rc, 1, key, 1, &nk), CSA2_OK, NULL, "publish");
        float zeros[2 * 512] = {0};
        DLTensor tz = tensor(zeros, 2, row_shape, kDLFloat, 32);
        expect_status(csa2_cache_write_entries(rc, 1, 2, CSA2_RECORD_MAIN, &te, &tz), CSA2_ERR_INVALID_ARGUMENT,
                      "read-only", "write published block");
        expect_status(csa2_cache_read_entries(rc, 1, 2, CSA2_RECORD_MAIN, &te, &tb), CSA2_OK, NULL, "read again");
        CHECK(memcmp(back + 288, rec + 2 * 288, 288) == 0, "refused batch changed nothing");

        /* SWA ring rows */
        int64_t one_shape[2] = {1, 512};
        DLTensor t1 = tensor(x, 2, one_shape, kDLFloat, 32);
        expect_status(csa2_cache_swa_write(rc, 1, 5, 300, &t1), CSA2_OK, NULL, "swa write");
        float sw[512];
        DLTensor ts = tensor(sw, 2, one_shape, kDLFloat, 32);
        expect_status(csa2_cache_swa_read(rc, 1, 5, 300, &ts), CSA2_OK, NULL, "swa read");
        CHECK(fabsf(sw[0] - x[0]) < 0.1f * (1 + fabsf(x[0])), "swa row survives (%f vs %f)", sw[0], x[0]);
        expect_status(csa2_cache_swa_read(rc, 1, 5, 301, &ts), CSA2_ERR_NOT_FOUND, "window", "swa read unwritten");
        int64_t newest = 0;
        expect_status(csa2_cache_swa_newest(rc, 1, 5, &newest), CSA2_OK, NULL, "swa newest");
        CHECK(newest == 301, "swa newest %lld", (long long)newest);

        /* stateful compressor: tokens 0 and 1 of layer 2 in two calls = one stateless call */
        float *norm = malloc(sizeof(float) * 512), *wk = malloc(sizeof(float) * 128 * 512),
              *kn = malloc(sizeof(float) * 128);
        for (int i = 0; i < 512; i++) norm[i] = 1.0f;
        for (int i = 0; i < 128 * 512; i++) wk[i] = 0.01f * sinf((float)i);
        for (int i = 0; i < 128; i++) kn[i] = 1.0f;
        int64_t n_shape[1] = {512}, wk_shape[2] = {128, 512}, kn_shape[1] = {128}, kv2_shape[2] = {2, 512};
        int64_t m1_shape[2] = {1, 288}, i1_shape[2] = {1, 68}, m0_shape[2] = {0, 288}, i0_shape[2] = {0, 68};
        DLTensor tn = tensor(norm, 1, n_shape, kDLFloat, 32), tw = tensor(wk, 2, wk_shape, kDLFloat, 32),
                 tk = tensor(kn, 1, kn_shape, kDLFloat, 32);
        DLTensor kv2 = tensor(x, 2, kv2_shape, kDLFloat, 32), sc2 = tensor(x + 512, 2, kv2_shape, kDLFloat, 32);
        uint8_t main_all[288], idx_all[68], main_b[288], idx_b[68];
        DLTensor tma = tensor(main_all, 2, m1_shape, kDLUInt, 8), tia = tensor(idx_all, 2, i1_shape, kDLUInt, 8);
        expect_status(csa2_compress(ARGS(Csa2CompressArgs, .geometry = cg, .layer = 2, .kv = &kv2, .score = &sc2, .norm = &tn, .wk = &tw, .k_norm = &tk, .start_pos = 0, .main_kv_out = &tma, .index_k_out = &tia)), CSA2_OK, NULL, "stateless");
        Csa2CompressorState *cs = NULL;
        expect_status(csa2_compressor_state_create(cg, 2, 1, &cs), CSA2_ERR_INVALID_ARGUMENT, "multiple",
                      "state at odd start");
        expect_status(csa2_compressor_state_create(cg, 2, 0, &cs), CSA2_OK, NULL, "state create");
        DLTensor kva = tensor(x, 2, one_shape, kDLFloat, 32), sca = tensor(x + 512, 2, one_shape, kDLFloat, 32);
        DLTensor kvb = tensor(x + 512, 2, one_shape, kDLFloat, 32), scb = tensor(x + 1024, 2, one_shape, kDLFloat, 32);
        DLTensor tm0 = tensor(main_b, 2, m0_shape, kDLUInt, 8), ti0 = tensor(idx_b, 2, i0_shape, kDLUInt, 8);
        DLTensor tm1 = tensor(main_b, 2, m1_shape, kDLUInt, 8), ti1 = tensor(idx_b, 2, i1_shape, kDLUInt, 8);
        uint64_t first = 99, next_pos = 0, pending = 0;
        expect_status(csa2_compress_step(ARGS(Csa2CompressStepArgs, .geometry = cg, .layer = 2, .state = cs, .kv = &kva, .score = &sca, .norm = &tn, .wk = &tw, .k_norm = &tk, .main_kv_out = &tm1, .index_k_out = &ti1, .first_entry = &first)), CSA2_ERR_SHAPE,
                      "main_kv_out", "step with wrong E");
        expect_status(csa2_compress_step(ARGS(Csa2CompressStepArgs, .geometry = cg, .layer = 2, .state = cs, .kv = &kva, .score = &sca, .norm = &tn, .wk = &tw, .k_norm = &tk, .main_kv_out = &tm0, .index_k_out = &ti0, .first_entry = &first)), CSA2_OK, NULL,
                      "step 1");
        expect_status(csa2_compressor_state_query(cs, &next_pos, &pending, NULL), CSA2_OK, NULL, "query");
        CHECK(next_pos == 1 && pending == 1, "after step 1: next %llu pending %llu", (unsigned long long)next_pos,
              (unsigned long long)pending);
        /* park the odd token in the cache, resume on a fresh handle */
        expect_status(csa2_compressor_state_save(cs, rc, 1), CSA2_OK, NULL, "save");
        csa2_compressor_state_free(cs);
        cs = NULL;
        expect_status(csa2_compressor_state_create(cg, 2, 0, &cs), CSA2_OK, NULL, "state create 2");
        expect_status(csa2_compressor_state_load(cs, rc, 1, 1), CSA2_OK, NULL, "load");
        /* the second token: the pair's kv row is x[512..1024) in the stateless call */
        kvb.data = x + 512;
        scb.data = x + 1024;
        expect_status(csa2_compress_step(ARGS(Csa2CompressStepArgs, .geometry = cg, .layer = 2, .state = cs, .kv = &kvb, .score = &scb, .norm = &tn, .wk = &tw, .k_norm = &tk, .main_kv_out = &tm1, .index_k_out = &ti1, .first_entry = &first)), CSA2_OK, NULL,
                      "step 2");
        CHECK(first == 0, "first entry %llu", (unsigned long long)first);
        CHECK(memcmp(main_b, main_all, 288) == 0 && memcmp(idx_b, idx_all, 68) == 0,
              "split pair pools as one call");
        csa2_compressor_state_free(cs);

        /* candidate-restricted indexer: 1 token at position 9 (ratio 1), 16 keys, block 1 of 8 */
        float q[128], w1 = 1.0f, keys[16 * 128], logits[16];
        for (int i = 0; i < 128; i++) q[i] = 0.1f;
        for (int i = 0; i < 16 * 128; i++) keys[i] = 0.05f * (float)(i % 5);
        int64_t pos[1] = {9};
        int32_t blocks[1] = {1};
        int64_t q_shape[3] = {1, 1, 128}, w_shape[2] = {1, 1}, p_shape[1] = {1}, k_shape[2] = {16, 128},
                b_shape[2] = {1, 1}, l_shape[2] = {1, 16};
        DLTensor tq = tensor(q, 3, q_shape, kDLFloat, 32), tw1 = tensor(&w1, 2, w_shape, kDLFloat, 32),
                 tp = tensor(pos, 1, p_shape, kDLInt, 64), tkk = tensor(keys, 2, k_shape, kDLFloat, 32),
                 tbl = tensor(blocks, 2, b_shape, kDLInt, 32), tl = tensor(logits, 2, l_shape, kDLFloat, 32);
        expect_status(csa2_indexer_logits_in_blocks(ARGS(Csa2IndexerLogitsInBlocksArgs, .q = &tq, .w = &tw1, .positions = &tp, .keys = &tkk, .blocks = &tbl, .ratio = 1, .block_size = 8, .q_quant = 0, .logits_out = &tl)), CSA2_OK, NULL,
                      "indexer in blocks");
        int ok_mask = 1;
        for (int j = 0; j < 16; j++) ok_mask &= (j >= 8 && j <= 9) ? isfinite(logits[j]) : isinf(logits[j]);
        CHECK(ok_mask, "only entries 8 and 9 (block 1, visible) are scored");
        expect_status(csa2_indexer_logits_in_blocks(ARGS(Csa2IndexerLogitsInBlocksArgs, .q = &tq, .w = &tw1, .positions = &tp, .keys = &tkk, .blocks = NULL, .ratio = 1, .block_size = 8, .q_quant = 0, .logits_out = &tl)), CSA2_ERR_NULL_POINTER,
                      "blocks", "null blocks");
        free(norm);
        free(wk);
        free(kn);
        csa2_cache_free(rc);
    }

    {
        /* indexed attention: 1 token, 1 head; main rows {1} and SWA row {0} by slot list, checked
         * against the same softmax written out in double (sink in the denominator only). */
        float aq[512], amain[2 * 512], aswa[512], asink = 0.25f, aout[512], alse;
        for (int d = 0; d < 512; d++) {
            aq[d] = 0.02f * (float)((d % 7) - 3);
            amain[d] = 0.5f;
            amain[512 + d] = 0.01f * (float)(d % 11);
            aswa[d] = -0.03f * (float)(d % 5);
        }
        int32_t mi[2] = {1, -1}, si[1] = {0};
        int64_t aq_shape[3] = {1, 1, 512}, am_shape[2] = {2, 512}, mi_shape[2] = {1, 2},
                as_shape[2] = {1, 512}, si_shape[2] = {1, 1}, sk_shape[1] = {1}, lse_shape[2] = {1, 1};
        DLTensor taq = tensor(aq, 3, aq_shape, kDLFloat, 32), tam = tensor(amain, 2, am_shape, kDLFloat, 32),
                 tmi = tensor(mi, 2, mi_shape, kDLInt, 32), tas = tensor(aswa, 2, as_shape, kDLFloat, 32),
                 tsi = tensor(si, 2, si_shape, kDLInt, 32), tsk = tensor(&asink, 1, sk_shape, kDLFloat, 32),
                 tao = tensor(aout, 3, aq_shape, kDLFloat, 32), tal = tensor(&alse, 2, lse_shape, kDLFloat, 32);
        expect_status(csa2_attention_indexed(ARGS(Csa2AttentionIndexedArgs, .q = &taq, .main_kv = &tam, .main_format = CSA2_FORMAT_NVFP4, .main_idx = &tmi, .main_len = NULL, .swa_kv = &tas, .swa_format = CSA2_FORMAT_MXFP8, .swa_idx = &tsi, .swa_len = NULL, .sink = &tsk, .scale = 0.0f, .out = &tao, .lse = &tal)),
                      CSA2_OK, NULL, "attention indexed");
        const float *rows[2] = {amain + 512, aswa};
        double z[2], scale = 1.0 / sqrt(512.0);
        for (int r = 0; r < 2; r++) {
            z[r] = 0.0;
            for (int d = 0; d < 512; d++) z[r] += (double)aq[d] * rows[r][d];
            z[r] *= scale;
        }
        double m = fmax(fmax(z[0], z[1]), (double)asink);
        double e0 = exp(z[0] - m), e1 = exp(z[1] - m), den = e0 + e1 + exp((double)asink - m);
        double worst = 0.0;
        for (int d = 0; d < 512; d++) {
            double want = (e0 * rows[0][d] + e1 * rows[1][d]) / den;
            worst = fmax(worst, fabs(want - (double)aout[d]));
        }
        CHECK(worst < 1e-5, "indexed attention out differs by %g", worst);
        CHECK(fabs((double)alse - (m + log(e0 + e1))) < 1e-5, "indexed attention lse %g", (double)alse);
        mi[0] = 2; /* past the 2 main rows */
        expect_status(csa2_attention_indexed(ARGS(Csa2AttentionIndexedArgs, .q = &taq, .main_kv = &tam, .main_format = CSA2_FORMAT_NVFP4, .main_idx = &tmi, .main_len = NULL, .swa_kv = &tas, .swa_format = CSA2_FORMAT_MXFP8, .swa_idx = &tsi, .swa_len = NULL, .sink = &tsk, .scale = 0.0f, .out = &tao, .lse = &tal)),
                      CSA2_ERR_INVALID_ARGUMENT, "main_idx", "attention indexed bad id");
    }

    Csa2ReplayPlan *rp = NULL;
    expect_status(csa2_replay_plan(cg, 7, 1000, 512, 0, &rp), CSA2_ERR_INVALID_ARGUMENT, "mode", "bad mode");
    expect_status(csa2_replay_plan(cg, CSA2_REPLAY_BOUNDED, 1000, 512, 0, &rp), CSA2_OK, NULL, "replay plan");
    Csa2ReplaySummary rs;
    expect_status(csa2_replay_plan_summary(rp, &rs), CSA2_OK, NULL, "replay summary");
    CHECK(rs.num_layers == 40 && rs.hit_used == 512 && rs.kv_write_start == 512 && rs.kv_write_end == 1000,
          "replay summary: hit %llu", (unsigned long long)rs.hit_used);
    Csa2LayerRun lr;
    expect_status(csa2_replay_plan_layer(rp, 0, &lr), CSA2_OK, NULL, "replay layer 0");
    CHECK(lr.row_end == 1000 && lr.row_start <= 512, "layer 0 rows [%llu, %llu)", (unsigned long long)lr.row_start,
          (unsigned long long)lr.row_end);
    expect_status(csa2_replay_plan_layer(rp, 40, &lr), CSA2_ERR_INVALID_ARGUMENT, "out of range", "replay layer 40");
    size_t npe = 0;
    expect_status(csa2_replay_plan_protected_entries(rp, NULL, 0, &npe), CSA2_OK, NULL, "protected count");
    csa2_replay_plan_free(rp);
    csa2_geometry_free(cg);

    free(pool);
    free(x);
    free(y);
    free(rec);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("C smoke test passed\n");
    return 0;
}
