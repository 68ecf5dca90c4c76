"""cffi (ABI mode) bindings to our build of libllama: the part of llama.h that polykv-cpp uses, plus the
appended `llama_polykv_*` API.

The struct declarations below mirror llama.h at llama.cpp commit 0c1e57098 field by field (enums are
declared as `int`, which is how the C compiler lays them out); `tests/test_native.py` checks them against
the library's default parameters. The library is found in the installed package (`polykv_cpp/lib`) or in
the directory named by `POLYKV_CPP_LIB_DIR`.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from pathlib import Path

import cffi

from polykv_cpp.errors import NativeError

CDEF = r"""
typedef int32_t llama_pos;
typedef int32_t llama_token;
typedef int32_t llama_seq_id;

struct llama_vocab;
struct llama_model;
struct llama_context;
struct llama_sampler;
struct llama_memory_i;
typedef struct llama_memory_i * llama_memory_t;

typedef void (*ggml_log_callback)(int level, const char * text, void * user_data);
typedef bool (*llama_progress_callback)(float progress, void * user_data);

typedef struct llama_batch {
    int32_t n_tokens;
    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
} llama_batch;

struct llama_model_params {
    void * devices;
    const void * tensor_buft_overrides;
    int32_t n_gpu_layers;
    int split_mode;
    int load_mode;
    int lazy_mode;
    int32_t main_gpu;
    const float * tensor_split;
    llama_progress_callback progress_callback;
    void * progress_callback_user_data;
    const void * kv_overrides;
    bool vocab_only;
    bool check_tensors;
    bool use_extra_bufts;
    bool no_host;
    bool no_alloc;
    bool load_mtp;
};

struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    uint32_t n_rs_seq;
    uint32_t n_outputs_max;
    uint32_t n_outputs_max_per_seq;
    int32_t  n_threads;
    int32_t  n_threads_batch;
    int ctx_type;
    int rope_scaling_type;
    int pooling_type;
    int attention_type;
    int flash_attn_type;
    float    rope_freq_base;
    float    rope_freq_scale;
    float    yarn_ext_factor;
    float    yarn_attn_factor;
    float    yarn_beta_fast;
    float    yarn_beta_slow;
    uint32_t yarn_orig_ctx;
    float    defrag_thold;
    void * cb_eval;
    void * cb_eval_user_data;
    int type_k;
    int type_v;
    void * abort_callback;
    void * abort_callback_data;
    bool embeddings;
    bool offload_kqv;
    bool no_perf;
    bool op_offload;
    bool swa_full;
    bool kv_unified;
    void * samplers;
    size_t n_samplers;
    struct llama_context * ctx_other;
};

typedef struct llama_sampler_chain_params { bool no_perf; } llama_sampler_chain_params;

struct llama_perf_context_data {
    double t_start_ms;
    double t_load_ms;
    double t_p_eval_ms;
    double t_eval_ms;
    int32_t n_p_eval;
    int32_t n_eval;
    int32_t n_reused;
};

const char * llama_version(void);
struct llama_model_params   llama_model_default_params(void);
struct llama_context_params llama_context_default_params(void);
llama_sampler_chain_params  llama_sampler_chain_default_params(void);

void llama_backend_init(void);
void llama_backend_free(void);
void llama_log_set(ggml_log_callback log_callback, void * user_data);
const char * llama_print_system_info(void);
bool llama_supports_gpu_offload(void);
bool llama_supports_rpc(void);

typedef struct ggml_backend_reg * ggml_backend_reg_t;
ggml_backend_reg_t ggml_backend_reg_by_name(const char * name);
void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);
void ggml_backend_register(ggml_backend_reg_t reg);
size_t ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
typedef struct ggml_backend_device * ggml_backend_dev_t;
size_t ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
int ggml_backend_dev_type(ggml_backend_dev_t device);

struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
void llama_model_free(struct llama_model * model);
struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);

uint32_t llama_n_ctx(const struct llama_context * ctx);
uint32_t llama_n_batch(const struct llama_context * ctx);
uint32_t llama_n_ubatch(const struct llama_context * ctx);
llama_memory_t llama_get_memory(const struct llama_context * ctx);

const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
int32_t llama_model_n_ctx_train(const struct llama_model * model);
int32_t llama_model_n_embd(const struct llama_model * model);
int32_t llama_model_n_layer(const struct llama_model * model);
int32_t llama_model_n_head(const struct llama_model * model);
int32_t llama_model_n_head_kv(const struct llama_model * model);
int32_t llama_model_n_swa(const struct llama_model * model);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
int32_t llama_model_meta_count(const struct llama_model * model);
int32_t llama_model_meta_key_by_index(const struct llama_model * model, int32_t i, char * buf, size_t buf_size);
int32_t llama_model_meta_val_str_by_index(const struct llama_model * model, int32_t i, char * buf, size_t buf_size);
int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
uint64_t llama_model_size(const struct llama_model * model);
uint64_t llama_model_n_params(const struct llama_model * model);

typedef struct llama_chat_message {
    const char * role;
    const char * content;
} llama_chat_message;
const char * llama_model_chat_template(const struct llama_model * model, const char * name);
int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
                                  bool add_ass, char * buf, int32_t length);

int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
llama_token llama_vocab_bos(const struct llama_vocab * vocab);
llama_token llama_vocab_eos(const struct llama_vocab * vocab);
bool llama_vocab_get_add_bos(const struct llama_vocab * vocab);

int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                       llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf, int32_t length,
                             int32_t lstrip, bool special);
int32_t llama_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
                         char * text, int32_t text_len_max, bool remove_special, bool unparse_special);

struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
void llama_batch_free(struct llama_batch batch);
int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
void llama_set_n_threads(struct llama_context * ctx, int32_t n_threads, int32_t n_threads_batch);
void llama_synchronize(struct llama_context * ctx);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);

void llama_memory_clear(llama_memory_t mem, bool data);
bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1);
llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);

size_t llama_state_get_size(struct llama_context * ctx);
size_t llama_state_get_data(struct llama_context * ctx, uint8_t * dst, size_t size);
size_t llama_state_set_data(struct llama_context * ctx, const uint8_t * src, size_t size);
bool llama_state_load_file(struct llama_context * ctx, const char * path_session, llama_token * tokens_out,
                           size_t n_token_capacity, size_t * n_token_count_out);
bool llama_state_save_file(struct llama_context * ctx, const char * path_session, const llama_token * tokens,
                           size_t n_token_count);

struct llama_sampler * llama_sampler_chain_init(llama_sampler_chain_params params);
void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
struct llama_sampler * llama_sampler_init_greedy(void);
struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
struct llama_sampler * llama_sampler_init_top_k(int32_t k);
struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_temp(float t);
struct llama_sampler * llama_sampler_init_penalties(int32_t n_vocab, int32_t penalty_last_n, float penalty_repeat, float penalty_freq, float penalty_present);
struct llama_sampler * llama_sampler_init_dry(const struct llama_vocab * vocab, float dry_multiplier, float dry_base, int32_t dry_allowed_length, int32_t dry_penalty_last_n, const char ** seq_breakers, size_t num_breakers);
llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
void llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
typedef struct llama_token_data { llama_token id; float logit; float p; } llama_token_data;
typedef struct llama_token_data_array { llama_token_data * data; size_t size; int64_t selected; bool sorted; } llama_token_data_array;
void llama_sampler_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p);
void llama_sampler_reset(struct llama_sampler * smpl);
void llama_sampler_free(struct llama_sampler * smpl);

struct llama_perf_context_data llama_perf_context(const struct llama_context * ctx);

struct llama_polykv_layer_stats {
    int32_t  layer;
    int32_t  group;
    int32_t  pattern_prefill;
    int32_t  pattern_decode;
    int32_t  budget_prefill;
    int32_t  budget_decode;
    uint32_t capacity;
    uint32_t used;
    uint64_t n_evicted;
    uint64_t bytes;
    uint64_t bytes_fullkv;
};

const char * llama_polykv_version(void);
const char * llama_polykv_llama_commit(void);
int32_t llama_polykv_set_model_plan(struct llama_model * model, const char * plan_json, int32_t kv_budget);
int32_t llama_polykv_set_model_prefill_mode(struct llama_model * model, int32_t mode);
int32_t llama_polykv_set_model_prefill_slack(struct llama_model * model, float slack);
bool    llama_polykv_is_active(const struct llama_context * ctx);
int32_t llama_polykv_get_layer_stats(const struct llama_context * ctx, struct llama_polykv_layer_stats * out, int32_t n_max);
int32_t llama_polykv_get_kept_positions(const struct llama_context * ctx, int32_t il, llama_pos * out, int32_t n_max);
int32_t llama_polykv_get_kept_positions_head(const struct llama_context * ctx, int32_t il, int32_t head, llama_pos * out, int32_t n_max);
int32_t llama_polykv_seq_get_kept_positions(const struct llama_context * ctx, llama_seq_id seq_id, int32_t il, int32_t head, llama_pos * out, int32_t n_max);
int32_t llama_polykv_layer_per_head(const struct llama_context * ctx, int32_t il);
const char * llama_polykv_pattern_str(int32_t pattern);
const char * llama_polykv_last_error(void);
int64_t llama_polykv_compress_prompt(struct llama_context * ctx);
int64_t llama_polykv_compress_prompt_kvzip(struct llama_context * ctx, const llama_token * prefix, int32_t n_prefix,
                                           const llama_token * tokens, int32_t n_tokens, int32_t n_chunk);
int32_t llama_polykv_get_kept_scores(const struct llama_context * ctx, int32_t il, int32_t head, float * out, int32_t n_max);
int32_t llama_polykv_model_layer_window(const struct llama_model * model, int32_t il);
int32_t llama_polykv_set_prompt_probing(struct llama_context * ctx, bool on);
int32_t llama_polykv_set_phase(struct llama_context * ctx, int32_t phase);
int32_t llama_polykv_get_decode_timing(const struct llama_context * ctx, double * select_ms, int64_t * n_steps);
int32_t llama_polykv_layer_cell_pad(const struct llama_context * ctx, int32_t il);
int32_t llama_polykv_get_shared_ubatches(const struct llama_context * ctx, int64_t * n_ubatches, int64_t * n_tokens);
int32_t llama_polykv_get_device_repacks(const struct llama_context * ctx, int64_t * n_repacks);
int64_t llama_polykv_probe_prompt(struct llama_context * ctx, const llama_token * tokens, int32_t n_tokens);
int32_t llama_polykv_score_prompt_kvzip(struct llama_context * ctx, const llama_token * prefix, int32_t n_prefix,
                                        const llama_token * tokens, int32_t n_tokens, int32_t n_chunk);
"""

LIB_NAMES = {"linux": "libllama.so", "darwin": "libllama.dylib", "win32": "llama.dll"}

ffi = cffi.FFI()
ffi.cdef(CDEF)

_lock = threading.Lock()
_lib = None
_log_lines: collections.deque[tuple[int, int, str]] = collections.deque(maxlen=200)
_log_count = 0
_log_skipping = False  # the line being continued was a debug line
GGML_LOG_LEVEL_ERROR = 4
GGML_LOG_LEVEL_WARN = 3
GGML_LOG_LEVEL_CONT = 5
GGML_LOG_LEVEL_DEBUG = 1


def lib_dir() -> Path:
    env = os.environ.get("POLYKV_CPP_LIB_DIR")
    return Path(env) if env else Path(__file__).resolve().parent / "lib"


def bin_dir() -> Path:
    env = os.environ.get("POLYKV_CPP_BIN_DIR")
    return Path(env) if env else Path(__file__).resolve().parent / "bin"


@ffi.callback("void(int, const char *, void *)")
def _log_callback(level, text, _user_data):
    global _log_count, _log_skipping
    if level == GGML_LOG_LEVEL_DEBUG or (level == GGML_LOG_LEVEL_CONT and _log_skipping):
        # not kept: a graph build logs a debug line per input tensor, hundreds per context, which would push the
        # warnings and information out of the bounded history
        _log_skipping = True
        return
    _log_skipping = False
    msg = ffi.string(text).decode("utf-8", "replace") if text != ffi.NULL else ""
    if level == GGML_LOG_LEVEL_CONT and _log_lines:
        seq, prev_level, prev = _log_lines[-1]
        _log_lines[-1] = (seq, prev_level, prev + msg)
    else:
        _log_count += 1
        _log_lines.append((_log_count, level, msg))
    if _verbose:
        sys.stderr.write(msg)


_verbose = bool(os.environ.get("POLYKV_CPP_VERBOSE"))


def set_verbose(on: bool) -> None:
    """Echo llama.cpp's log (info and above) to stderr; by default it is kept for error messages only."""
    global _verbose
    _verbose = on


def log_mark() -> int:
    return _log_count


def log_since(mark: int, min_level: int = GGML_LOG_LEVEL_WARN) -> str:
    """The warnings and errors llama.cpp logged since `mark`, joined into one message."""
    lines = [text.strip() for seq, level, text in _log_lines if seq > mark and level >= min_level]
    return "; ".join(line for line in lines if line)


def load():
    """Load libllama once, initialise the backend and route its log through Python."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        name = LIB_NAMES.get(sys.platform, "libllama.so")
        path = lib_dir() / name
        if not path.exists():
            raise NativeError(
                f"libllama not found at {path}: install polykv-cpp with `pip install .` "
                "(which builds it) or set POLYKV_CPP_LIB_DIR to a directory holding our build")
        try:
            lib = ffi.dlopen(str(path))
        except OSError as e:
            raise NativeError(f"cannot load {path}: {e}") from e
        try:
            lib.llama_polykv_version
        except AttributeError as e:
            raise NativeError(f"{path} is a libllama without the polykv-cpp extension") from e
        lib.llama_log_set(_log_callback, ffi.NULL)
        lib.llama_backend_init()
        _lib = lib
        return lib


GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU = 1, 2


def has_gpu() -> bool:
    """A local GPU device (CUDA, Metal, ...) is there. Not `llama_supports_gpu_offload`, which is also true of a
    build with the RPC backend and no GPU; RPC servers added by :func:`add_rpc_servers` count as GPUs here."""
    lib = load()
    return any(lib.ggml_backend_dev_type(lib.ggml_backend_dev_get(i)) in (GGML_BACKEND_DEVICE_TYPE_GPU,
                                                                         GGML_BACKEND_DEVICE_TYPE_IGPU)
               for i in range(lib.ggml_backend_dev_count()))


_rpc_servers: dict[str, int] = {}


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise NativeError(f"RPC server {endpoint!r}: expected host:port (e.g. 192.168.1.20:50052)")
    return host.strip("[]"), int(port)


def _check_reachable(endpoint: str, timeout: float = 5.0) -> None:
    """ggml-rpc aborts the process when it cannot connect: try the connection first, to say so instead."""
    import socket

    try:
        socket.create_connection(_split_endpoint(endpoint), timeout=timeout).close()
    except OSError as e:
        raise NativeError(f"RPC server {endpoint}: cannot connect ({e}); start ggml-rpc-server there "
                          "(`ggml-rpc-server -H ADDRESS -p PORT`)") from None


def add_rpc_servers(endpoints: str | list[str]) -> dict[str, int]:
    """Register llama.cpp RPC servers (``host:port``, a list or one comma-separated string; each a running
    ``ggml-rpc-server``) as devices, as llama.cpp's ``--rpc`` does: models loaded afterwards in this process put
    their offloaded layers (``n_gpu_layers``) and those layers' KV caches there. Returns endpoint -> devices.
    A server is asked for its devices once per process (registering it twice would list its devices twice)."""
    if isinstance(endpoints, str):
        endpoints = endpoints.split(",")
    endpoints = [e.strip() for e in endpoints]
    for e in endpoints:
        _split_endpoint(e)
    lib = load()
    with _lock:
        if not lib.llama_supports_rpc():
            raise NativeError("this build has no RPC backend (built with -DPOLYKV_RPC=OFF)")
        reg = lib.ggml_backend_reg_by_name(b"RPC")
        add = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
        if add == ffi.NULL:
            raise NativeError("the RPC backend has no ggml_backend_rpc_add_server")
        add_server = ffi.cast("ggml_backend_reg_t (*)(const char *)", add)
        for e in endpoints:
            if e in _rpc_servers:
                continue
            _check_reachable(e)
            mark = log_mark()
            server = add_server(e.encode())
            if server == ffi.NULL:
                raise NativeError(f"RPC server {e}: no devices (is ggml-rpc-server running there? "
                                  f"{log_since(mark, GGML_LOG_LEVEL_WARN) or 'no detail logged'})")
            lib.ggml_backend_register(server)
            _rpc_servers[e] = int(lib.ggml_backend_reg_dev_count(server))
    return {e: _rpc_servers[e] for e in endpoints}


def version_info() -> dict[str, str]:
    lib = load()
    return {
        "polykv": ffi.string(lib.llama_polykv_version()).decode(),
        "llama_commit": ffi.string(lib.llama_polykv_llama_commit()).decode(),
        "system": ffi.string(lib.llama_print_system_info()).decode(),
    }
