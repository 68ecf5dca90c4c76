#pragma once

// PolyKV (polykv-cpp): per-layer, per-phase KV-cache eviction driven by a stored plan.
//
// With a plan, the model's KV memory is a llama_kv_cache_poly: one llama_kv_cache per group of layers, each of
// its own real size (budget + one ubatch of headroom). After every ubatch the cells of each group are brought
// back to the group's budget for the current phase by its eviction pattern. Attention scores for the
// attention-based patterns come from a small score branch in the graph (see llama_polykv_build_scores).
// docs/design.md and docs/patterns.md describe the behaviour; polykv_cpp/patterns.py is the reference.

#include "llama.h"
#include "llama-polykv-plan.h"
#include "llama-graph.h"
#include "llama-kv-cache.h"
#include "llama-memory.h"
#include "llama-io.h"

#include "ggml-cpp.h"

#include <array>
#include <memory>
#include <string>
#include <vector>

#define LLAMA_POLYKV_LLAMA_COMMIT "0c1e57098"

#ifndef LLAMA_POLYKV_VERSION
#define LLAMA_POLYKV_VERSION "dev"
#endif

// portable prefill keeps the attention rows of this many last queries (SnapKV/PyramidKV plans read at most this many)
#define LLAMA_POLYKV_PORTABLE_OBS_WINDOW 64

struct llama_model;
struct llama_cparams;
struct llama_memory_params;

//
// llama_kv_cache_poly
//

// the RoPE of one layer, as Expected Attention undoes it for query statistics and averages it over future positions
struct ea_rope {
    int32_t n_rot      = 0;
    int32_t mode       = 0;     // LLAMA_ROPE_TYPE_NORM (adjacent pairs) or LLAMA_ROPE_TYPE_NEOX (halves)
    float   freq_base  = 10000.0f;
    float   freq_scale = 1.0f;
};

class llama_kv_cache_poly : public llama_memory_i {
public:
    struct group {
        std::unique_ptr<llama_kv_cache> kv;

        std::vector<int32_t> layers;
        std::array<llama_polykv_phase_plan, 2> phase;

        uint32_t capacity  = 0;
        uint32_t capacity_max = 0; // what the group may hold (exact modes: n_ctx); capacity shrinks after a compression
        uint32_t pad = 32;         // cell counts are multiples of it
        uint64_t n_evicted = 0;

        // per-head selection (groups of one layer): every KV head keeps its own tokens in the group's cells;
        // hpos[h*capacity + c] is the position head h holds in cell c (-1: none). The stock cache's cell of c
        // carries the largest of them, so that it is free only when every head left it (see repack)
        bool per_head = false;
        uint32_t n_head_kv = 1;
        std::vector<llama_pos> hpos;
        // pooled heads (adaptive groups, V not transposed, not portable): the layer's (cell, head) slots are one
        // pool, any KV head's token may sit in any slot, so that heads of different lengths take exactly the slots
        // they keep. howner[u] is the KV head whose token slot u (= s*capacity + c: head slot s of cell c) holds;
        // the graph attends over the slots as one KV head, masked per KV head by owner (llama_polykv_view_kv).
        // Without pooling every slot is its own head's (howner[u] == u / capacity)
        bool pooled = false;
        std::vector<uint8_t> howner;
        uint32_t owner_of(size_t u) const { return pooled ? howner[u] : (uint32_t) (u / capacity); }
        // the attention takes each KV head apart: as a stream (per head) or as a block of query rows (pooled slots)
        bool heads_apart() const { return per_head && n_head_kv > 1; }

        // per-cell score state of attention/key based patterns (groups of one layer), in slots of capacity
        // cells: the layer's (slot 0, layer selection), each KV head's (head_off(h), per-head selection), or
        // both (portable prefill, which must serve either kind of plan)
        std::vector<float> acc;                // H2O: attention received, accumulated
        std::vector<float> last;               // TOVA: attention from the last query
        std::vector<float> knorm;              // K-norm: ||k||, the mean over KV heads for layer selection
        std::vector<std::vector<float>> ring;  // SnapKV: the last obs_window query rows
        std::vector<float> zmax;               // KVzip: the largest attention from a reconstruction query
        std::vector<float> ea;                 // Expected Attention: the scores of the last eviction

        // Expected Attention: moments of the pre-RoPE queries seen so far (positions >= n_sink), per query head:
        // ea_sum[h*d + a] = sum of q_a, ea_sq[(h*d + a)*d + b] = sum of q_a q_b, over ea_n queries
        double ea_n = 0.0;
        uint32_t ea_new = 0;                   // queries of the last ubatch that count
        std::vector<double> ea_sum;
        std::vector<double> ea_sq;
        ea_rope rope;                          // how the layer rotates queries and keys
        float ea_kq_scale = 1.0f;              // the layer's attention scale (set when its graph is built)

        // graph outputs of the last ubatch (valid until the next graph is computed)
        ggml_tensor * t_rows  = nullptr; // [1, n_kv, n_rows]: attention of the last rows queries, mean over
                                         // the query heads of the layer
        ggml_tensor * t_rows_heads = nullptr; // [n_head_kv, n_kv, n_rows]: the same, mean over each KV head's
        ggml_tensor * t_knorm = nullptr; // [n_head_kv, n_tokens]: ||k|| of the new tokens per KV head
        ggml_tensor * t_ea_sum = nullptr; // [1, d, n_head]: sum of the ubatch's pre-RoPE queries (n_sink on)
        ggml_tensor * t_ea_sq  = nullptr; // [d, d, n_head]: sum of their outer products
        // those outputs on the host, copied together after the ubatch (fetch_scores)
        std::vector<std::pair<const ggml_tensor *, std::vector<float>>> fetched;
        // the sum of the ring's rows per cell (SnapKV's observation window), kept up to date row by row and
        // summed again every ring_size() rows (read_scores); any other change to the ring calls ring_changed()
        std::vector<double> win_sum;
        int32_t win_age = 0;
        bool win_ok = false;
        void ring_changed() { win_ok = false; }
        void clear_ring() { ring.clear(); ring_changed(); }
        std::vector<uint32_t> new_cells; // cells of the new tokens of the last ubatch
        bool rows_idle = false;          // this decode step's attention rows would be read by no eviction (evict_every)

        bool layer_scores() const { return !per_head || collect_all; }
        bool head_scores()  const { return per_head || collect_all; }
        // the query rows the score state keeps (SnapKV/PyramidKV observation window; every pattern's when portable)
        int32_t ring_size() const;
        uint32_t n_slots() const { return (layer_scores() ? 1 : 0) + (head_scores() ? n_head_kv : 0); }
        size_t head_off(uint32_t h) const { return (size_t) ((layer_scores() ? 1 : 0) + h) * capacity; }

        bool is_swa = false; // sliding-window layers: the window masks, eviction may shrink further
        bool collect_all = false; // portable prefill: keep the score state of every pattern

        // the budgets the plan gives the group's phases; "allocation": "prompt" changes phase[].budget per prompt
        std::array<int32_t, 2> plan_budget = { -1, -1 };

        // the pattern this group evicts by while a chunked prompt streams (plan "stream"), -1: its prefill pattern
        int32_t stream = -1;
        // the prefill phase with the stream pattern (its budget, sinks, windows, kernel and selection)
        llama_polykv_phase_plan streamed_prefill() const {
            llama_polykv_phase_plan res = phase[0];
            res.pattern = (llama_polykv_pattern) stream;
            return res;
        }

        bool needs_scores() const {
            return collect_all || phase[0].needs_scores() || phase[1].needs_scores() || (stream >= 0 && streamed_prefill().needs_scores());
        }
        // attention rows of the prompt and decode queries (every score pattern but KVzip, whose rows come from
        // its own reconstruction pass)
        bool needs_rows() const {
            return collect_all || phase[0].reads_rows() || phase[1].reads_rows() || (stream >= 0 && streamed_prefill().reads_rows());
        }
        bool needs(llama_polykv_pattern p) const {
            return collect_all || phase[0].pattern == p || phase[1].pattern == p || stream == (int32_t) p;
        }
    };

    llama_kv_cache_poly(
            const llama_model & model,
          const llama_hparams & hparams,
            llama_polykv_plan   plan,
                      int32_t   prefill_mode,
                        float   prefill_slack,
                    ggml_type   type_k,
                    ggml_type   type_v,
                         bool   v_trans,
                         bool   offload,
                     uint32_t   n_ctx,
                     uint32_t   n_ubatch,
                 llama_seq_id   seq = 0,
                     uint32_t   n_seq_max = 1);

    ~llama_kv_cache_poly() = default;

    //
    // llama_memory_i
    //

    llama_memory_context_ptr init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) override;
    llama_memory_context_ptr init_full() override;
    llama_memory_context_ptr init_update(llama_context * lctx, bool optimize) override;

    bool get_can_shift() const override;

    void clear(bool data) override;

    bool seq_rm  (llama_seq_id seq_id,                              llama_pos p0, llama_pos p1) override;
    void seq_cp  (llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) override;
    void seq_keep(llama_seq_id seq_id)                                                          override;
    void seq_add (llama_seq_id seq_id,                              llama_pos p0, llama_pos p1, llama_pos shift) override;
    void seq_div (llama_seq_id seq_id,                              llama_pos p0, llama_pos p1, int d) override;

    llama_pos seq_pos_min(llama_seq_id seq_id) const override;
    llama_pos seq_pos_max(llama_seq_id seq_id) const override;

    std::map<ggml_backend_buffer_type_t, size_t> memory_breakdown() const override;

    void state_write(llama_io_write_i & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) const override;
    void state_read (llama_io_read_i  & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) override;

    //
    // PolyKV
    //

    uint32_t n_groups() const { return groups.size(); }
    int32_t  group_of(int32_t il) const { return layer_group[il]; }
    group &  get_group(uint32_t g) { return groups[g]; }
    const group & get_group(uint32_t g) const { return groups[g]; }

    bool inputs_pack_logged = false; // llama_polykv_build_input said once that it packs the groups' inputs

    const llama_polykv_plan & get_plan() const { return plan; }
    uint32_t get_n_ctx() const { return n_ctx; }
    // cells of the SWA cache stock llama.cpp gives a sliding-window layer at its tools' defaults (no --swa-full):
    // the window of each of n_seq sequences + one ubatch, padded to 256 (llama_kv_cache_iswa)
    uint32_t stock_swa_cells(uint32_t n_ctx_total, uint32_t n_seq) const {
        return GGML_PAD(std::min(n_ctx_total, hparams.n_swa * n_seq + n_ubatch), 256);
    }
    // the sequence this cache holds (a context of several sequences has one llama_kv_cache_poly per sequence)
    llama_seq_id get_seq() const { return seq; }

    // remember where the tokens of a ubatch went, reset the score state of those cells
    void on_placed(uint32_t g, const std::vector<uint32_t> & cells, const llama_ubatch & ubatch);

    // before a ubatch is placed: in exact prefill mode, the first decode step first compresses the prompt
    void before_ubatch(const llama_ubatch & ubatch);

    // what the next ubatch's phase and cut depend on: the prompt tokens fed since the last prompt eviction
    // (chunked prefill) and whether the sequence's last ubatch asked for logits
    struct feed_state {
        uint32_t n_open      = 0;
        bool     prev_output = true;
    };
    // chunked prefill: a prompt streams in chunks of n_ubatch tokens counted from its first token (or from the
    // last eviction), whatever pieces the caller's batches cut it into, so what is kept does not depend on how a
    // server shares its batches between slots. init_batch cuts a sequence's next ubatch at `ubatch_room` tokens
    // and follows the state through the batch with `feed_after`
    const feed_state & get_feed() const { return feed; }
    uint32_t ubatch_room(const feed_state & fs) const {
        return chunks_aligned() ? n_ubatch - std::min(fs.n_open, n_ubatch - 1) : n_ubatch;
    }
    feed_state feed_after(feed_state fs, const llama_ubatch & ubatch) const;
    // a token of this sequence may share its ubatch with other sequences' tokens (llama_kv_cache_poly_seqs): it is a
    // decode step (output asks for logits) and no reconstruction pass or probe is running
    bool shares_ubatch(bool output, const feed_state & fs) const;

    // after a ubatch was computed: read the score outputs and evict every group down to its budget
    void after_ubatch(llama_context * lctx, const llama_ubatch & ubatch);
    // exact prefill modes and slack: compress the prompt fed so far now instead of at the first decode step;
    // returns the number of cells freed over all groups
    uint64_t compress_prompt();

    // KVzip (exact prefill modes, the prompt not compressed yet): feed prefix + each chunk of the prompt's tokens
    // after the prompt, record for every prompt token the largest attention a reconstruction query gives it,
    // remove the reconstruction tokens, then compress the prompt; returns the cells freed. Throws on misuse.
    uint64_t compress_prompt_kvzip(llama_context * lctx, const llama_token * prefix, int32_t n_prefix,
                                   const llama_token * tokens, int32_t n_tokens, int32_t n_chunk);
    // the same pass without the compression: the prompt stays whole and scored (a state saved now carries the
    // scores, so one pass serves every plan a portable state is loaded into)
    void score_prompt_kvzip(llama_context * lctx, const llama_token * prefix, int32_t n_prefix,
                            const llama_token * tokens, int32_t n_tokens, int32_t n_chunk);
    // true while the reconstruction pass runs (the graph scores only KVzip layers, nothing is evicted)
    bool kvzip_pass() const { return kvzip_active; }

    // FINCH-style probing of a streaming prompt (Corallo & Papotti 2024, "FINCH: Prompt-guided Key-Value Cache
    // Compression"): while on, a prompt ubatch keeps its tokens until probe_prompt scores them by the probe's
    // queries (or until the next prompt ubatch evicts by the chunk's own rows); throws in exact prefill modes
    void set_prompt_probing(bool on);

    // the phase of the next ubatches: -1 auto (a ubatch of one token is a decode step), else LLAMA_POLYKV_PHASE_*
    void set_phase(int32_t phase) { phase_set = phase; }
    // host time of the evictions after decode steps (llama_polykv_get_decode_timing)
    int64_t decode_select_us() const { return t_decode_select_us; }
    int64_t decode_steps() const { return n_decode_steps; }
    // repacks whose K/V copies ran as a graph on the caches' device (llama_polykv_get_device_repacks)
    int64_t device_repacks() const { return n_device_repacks; }

    // feed the probe after the prompt so far, read its rows into the score state, remove it, evict every group to
    // its streaming budget by its prompt pattern; returns the cells freed. Throws on misuse
    uint64_t probe_prompt(llama_context * lctx, const llama_token * tokens, int32_t n_tokens);

    // kept positions of a layer (sorted); head >= 0: those of one KV head (per-head selection), head < 0: the
    // union over the heads
    std::vector<llama_pos> kept_positions(int32_t il, int32_t head = -1) const;
    // the score the layer's prefill pattern ranks each kept token by (position order; head -1: the layer's
    // scores, else KV head `head`'s); false when the layer keeps no such scores
    bool kept_scores(int32_t il, int32_t head, std::vector<float> & out) const;

    // what the graph of a ubatch is built from besides the ubatch's shape and the groups' n_kv: the group caches'
    // tensors, the score branch of every group (llama_polykv_build_scores) and the extra inputs. A graph is reused
    // only while its key is unchanged (llm_graph_input_attn_kv_poly::can_reuse): whatever the graph builders read
    // from the cache's state must be in it
    std::vector<int64_t> graph_key(bool record) const;

    // per-head groups: the attention mask input of a ubatch, [n_kv, n_tokens, 1, n_head_kv] (one slice per KV head;
    // the graph widens it to one per query head). Pooled groups: [n_kv*n_head_kv, n_tokens] (a slot seen by its
    // position alone), and set_input_owner_mask: [n_kv*n_head_kv, 1, n_head_kv] (0 where the KV head owns the slot)
    void set_input_kq_mask_heads(uint32_t g, ggml_tensor * dst, const llama_ubatch * ubatch) const;
    void set_input_owner_mask(uint32_t g, ggml_tensor * dst) const;

    size_t group_bytes(uint32_t g) const;

    // Expected Attention: each layer's RoPE (from the context parameters); throws for a RoPE it cannot follow
    void set_rope(const llama_model & model, const llama_cparams & cparams);
    // Expected Attention: the n_sink of the layer's prefill phase (queries before it are left out of the statistics)
    static int32_t ea_n_sink(const group & grp) { return grp.phase[0].n_sink; }

private:
    const llama_model & model;
    const llama_hparams & hparams;

    llama_polykv_plan plan;

    const uint32_t n_ctx;
    const uint32_t n_ubatch;
    const bool v_trans;
    const bool offload;
    const ggml_type type_k;
    const ggml_type type_v;
    const llama_seq_id seq;      // the one sequence this cache holds
    const uint32_t n_seq_max;    // the context's (the stock group caches take seq ids below it)

    // exact prefill: keep the whole prompt, compress it once when decoding starts (caches of n_ctx cells);
    // portable (mode 2): also one group per layer that keeps the score state of every pattern, so that the
    // state saved after a prompt can be restored into a portable context with any other plan
    const bool prefill_exact;
    const bool portable;
    // chunked prefill with slack: a streaming prompt keeps up to slack x the prefill budget per layer and is
    // compressed to the budget when decoding starts (1 = plain chunked: every ubatch evicts to the budget)
    const float prefill_slack;
    bool prompt_pending = false;

    // 1 + the newest position fed (the sequence's logical end): eviction may drop that token from every layer,
    // but the next token still comes at pos_next, so seq_pos_max reports it; seq_rm and clear move it back
    llama_pos pos_next = 0;

    // the prompt was compressed (or decoding started): tokens fed from now on are a follow-up (plan.followup_decode)
    bool prompt_done = false;
    int64_t t_decode_select_us = 0;
    int64_t n_decode_steps = 0;
    int64_t n_device_repacks = 0;

    bool kvzip_active = false; // a reconstruction pass is running
    bool kvzip_scored = false; // the prompt in the cache was scored by one
    bool kvzip_warned = false;

    // chunked prefill with a "stream" pattern: streaming groups evict before each new prompt ubatch, not after
    bool streams = false;

    bool probing      = false; // prompt ubatches wait for a probe before they evict
    bool probe_active = false; // a probe is being decoded (its rows are read, nothing is evicted)
    bool probe_due    = false; // a prompt ubatch has not been evicted yet (no probe came after it so far)

    int32_t phase_set = -1; // llama_polykv_set_phase: -1 auto, else the phase of every ubatch
    // a ubatch of one token with logits is a decode step if the sequence's last ubatch asked for logits too (a
    // token was sampled from them); after prompt tokens without logits it is the prompt's last token
    bool is_decode(const llama_ubatch & ubatch, const feed_state & fs) const {
        return (phase_set >= 0 || ubatch.n_tokens == 1) && is_decode_token(ubatch.output[0] != 0, fs);
    }
    // the same for a ubatch of one token whose logits are asked for (output) or not
    bool is_decode_token(bool output, const feed_state & fs) const {
        return phase_set < 0 ? output && fs.prev_output : phase_set == LLAMA_POLYKV_PHASE_DECODE;
    }
    bool is_decode(const llama_ubatch & ubatch) const { return is_decode(ubatch, feed); }

    bool compresses_at_decode() const { return prefill_exact || prefill_slack > 1.0f || streams || probing; }

    // prompt tokens fed since the last prompt eviction (chunked prefill): a prompt ubatch evicts only when it
    // completes a chunk of n_ubatch tokens or ends with an output (the caller's end of the prompt); otherwise
    // the eviction waits for the rest of the chunk, or for the next decode step
    feed_state feed;
    bool open_unknown = false; // restored from a state, which does not record the open chunk
    bool chunks_aligned() const { return !prefill_exact && !streams && !probing && !kvzip_active && !probe_active; }
    // "followup": "keep" once the prompt was compressed: nothing is evicted any more, the groups grow instead
    bool keeps_followups() const { return plan.followup_keep && prompt_done; }
    // after a decode step: the plan's evict_every says whether this group evicts now
    bool decode_evict_due(const group & grp) const;
    // decode tokens still to come before the group's eviction is due (0: due now)
    uint64_t decode_tokens_to_eviction(const group & grp) const;
    // before a decode step: no eviction will read its attention rows (the group evicts more than its decode
    // pattern's observation window of tokens later), so its graph computes none
    bool decode_rows_idle(const group & grp, const llama_ubatch & ubatch) const;
    uint32_t n_used_cells(const group & grp) const;
    // the prefill phase while a prompt streams: the budget times the slack (at most n_ctx)
    llama_polykv_phase_plan streaming_phase(const llama_polykv_phase_plan & pp) const;
    // how a group compresses prompt tokens: the prefill phase, or for a follow-up under a "followup": "decode" plan
    // the decode pattern at the prefill budget
    llama_polykv_phase_plan prompt_phase(const group & grp) const;
    // how a streaming group ("stream" plans, chunked prefill) evicts before a new prompt ubatch: the streaming
    // phase of its prompt phase, by the stream pattern
    llama_polykv_phase_plan stream_phase(const group & grp) const;

    std::vector<group>   groups;
    std::vector<int32_t> layer_group; // il -> group, -1 for layers without KV

    // unique in the process for each set of group cache tensors: a new value whenever a group cache is replaced
    // (graph_key; a graph's K/V views refer to the tensors it was built with)
    uint64_t layout_id = 0;
    void new_layout();

    // copy every group's score outputs to the host with one wait per backend, not one blocking read per layer
    void fetch_scores(ggml_backend_sched_t sched);
    // the score outputs of the last ubatch into the state; with_query_stats false: leave Expected Attention's
    // query statistics alone (a probe's queries are not the prompt's)
    void read_scores(group & grp, uint32_t n_tokens, bool with_query_stats = true);
    // make room for more of a streaming prompt: every group to its streaming budget (stream groups by the stream
    // pattern, unless by_prompt_pattern), returns the cells freed
    uint64_t evict_streaming(bool by_prompt_pattern);
    // Expected Attention (Devoto et al. 2025, kvpress ExpectedAttentionPress): score every cell of a group from the
    // query statistics, the average rotation of the next EA_N_FUTURE positions, and the cached keys and values
    void score_expected_attention(group & grp);
    // KVzip: fold the rows of a reconstruction ubatch into zmax (max over the rows)
    void read_kvzip(group & grp);
    void warn_kvzip_unscored(const group & grp);
    // "allocation": "prompt" (exact modes, the prompt's first compression): the budgets of the groups with a scored
    // prefill pattern (not sliding-window ones) re-split by their scores across the model, the layers of each
    // pattern among themselves, as polykv_cpp.patterns.allocate_prompt (KVzip's non-uniform allocation, with b_min
    // per layer); the decode budgets follow (allocated_decode_budget)
    void allocate_prompt();
    void allocate_pool(const std::vector<uint32_t> & cand);
    // every group back to the plan's budgets (a new prompt, a cleared or restored cache)
    void restore_plan_budgets();
    // move the kept cells of a group to its first cells (exact modes: after the prompt's compression the
    // kept tokens are spread over n_ctx cells, and attention would still span all of them)
    void compact(group & grp);
    // the (position, cell) pairs of one token set, oldest first: the layer's, or in a per-head group KV head h's as
    // (position, slot) pairs, the slot u = s*capacity + c indexing hpos and, after head_off(0), the score state
    std::vector<std::pair<llama_pos, uint32_t>> set_items(const group & grp, uint32_t h) const;
    // bring a group down to the budget of pp (llama-polykv-select.cpp)
    void evict(group & grp, const llama_polykv_phase_plan & pp);
    // per-head groups: move each head's kept tokens into the first cells (a pooled group: into any free slot of
    // them) and relabel the stock cells
    void repack(group & grp);
    // one (cell, head slot) row of a per-head group moved by repack: the slots differ only in pooled groups
    struct repack_move {
        uint32_t src_slot;
        uint32_t src;
        uint32_t dst_slot;
        uint32_t dst;
    };
    // the K/V copies of a repack as one graph on the caches' own device: get_rows of the moved (cell, head) rows,
    // set_rows at their new places; one round trip to a GPU or an RPC server instead of two per move, layer and
    // tensor. false: the host copies it (host buffers, quantized or transposed caches; LLAMA_POLYKV_DEVICE_REPACK
    // 1 forces the graph on host buffers too, 0 turns it off)
    bool repack_on_device(const group & grp, const std::vector<repack_move> & moves);
    struct device_repacker {
        ggml_backend_buffer_type_t buft;
        ggml_backend_ptr           backend;
        ggml_gallocr_ptr           galloc;
    };
    std::vector<device_repacker> repackers; // per buffer type, made on first use

    // the stock cache of a group with cap cells
    std::unique_ptr<llama_kv_cache> new_group_cache(const group & grp, uint32_t cap) const;
    // cells a group needs: the larger phase budget (x the prefill slack while a prompt streams) + one ubatch, padded;
    // whole_prompt: the prefill phase keeps the whole prompt (exact modes until the compression)
    uint32_t group_cells(const group & grp, bool whole_prompt) const;
    // move a group's cells into a cache of cap cells, with their score state (the kept cells must fit; they are
    // compacted first): exact modes shrink the caches after a compression, and grow them for the next prompt
    void resize(group & grp, uint32_t cap);
    // an empty group cache of cap cells, its score state zeroed
    void reset_capacity(group & grp, uint32_t cap);

public:
    // exact modes: a group without room for n_tokens more cells grows back to capacity_max; false if it cannot
    bool make_room(group & grp, uint32_t n_tokens);
};

class llama_kv_cache_poly_seqs;

class llama_kv_cache_poly_context : public llama_memory_context_i {
public:
    llama_kv_cache_poly_context(llama_memory_status status);
    llama_kv_cache_poly_context(llama_kv_cache_poly * kv);                                          // full
    llama_kv_cache_poly_context(llama_kv_cache_poly * kv, std::vector<llama_ubatch> ubatches);      // batch
    // several sequences: ubatch i goes to the cache of its sequence, ubatch_kv[i]; where that is nullptr, the ubatch
    // holds decode steps of several sequences and apply() gives each sequence's tokens to a context of their own
    // (the parts)
    llama_kv_cache_poly_context(const llama_kv_cache_poly_seqs * seqs, std::vector<llama_kv_cache_poly *> ubatch_kv,
                                std::vector<llama_ubatch> ubatches);

    bool next()  override;
    bool apply() override;

    llama_memory_status  get_status() const override;
    const llama_ubatch & get_ubatch() const override;

    uint32_t n_groups() const { return group_ctxs.size(); }
    const llama_kv_cache_context * get_group(uint32_t g) const;
    llama_kv_cache_poly * get_poly() const { return kv; }

    // true while building the graph of a real ubatch (not a worst-case reservation)
    bool is_batch() const { return !ubatches.empty(); }

    // a ubatch of several sequences: one context per sequence, in the order of its tokens in the ubatch
    uint32_t n_parts() const { return parts.size(); }
    const llama_kv_cache_poly_context * get_part(uint32_t i) const { return parts[i].get(); }

private:
    llama_memory_status status;

    llama_kv_cache_poly * kv = nullptr;

    size_t i_cur = 0;
    std::vector<llama_ubatch> ubatches;
    std::vector<llama_kv_cache_poly *> ubatch_kv; // empty: every ubatch goes to kv
    const llama_kv_cache_poly_seqs * seqs = nullptr;
    llama_kv_cache_poly * ubatch_cache(size_t i) const;

    std::vector<llama_memory_context_ptr> group_ctxs;
    std::vector<std::unique_ptr<llama_kv_cache_poly_context>> parts;
};

// rows [i0, i0 + n) of a ubatch as a ubatch of its own (the tokens of one sequence in a ubatch of several)
llama_ubatch llama_polykv_ubatch_rows(const llama_ubatch & ubatch, uint32_t i0, uint32_t n);
// the parts of a ubatch: runs of consecutive tokens of one sequence, as (first row, rows)
std::vector<std::pair<uint32_t, uint32_t>> llama_polykv_ubatch_seq_runs(const llama_ubatch & ubatch);

// at most this many sequences' decode steps share a ubatch (the graph builds attention once per sequence; see
// llama_polykv_graph_extra_nodes)
#define LLAMA_POLYKV_MAX_SHARED_SEQS 16

//
// llama_kv_cache_poly_seqs: several sequences with a plan
//

// One llama_kv_cache_poly per sequence, each with the plan's budgets in every layer: one sequence's tokens never
// evict another's, and every sequence is compressed exactly as it would be alone. A prompt's ubatch holds the tokens
// of one sequence (llama_batch_allocr::split_seq); a batch of decode steps only (one token per sequence, as
// llama-server's slots generate) shares ubatches of up to LLAMA_POLYKV_MAX_SHARED_SEQS sequences: the weights are
// read once and attention runs per sequence on its own caches (LLAMA_POLYKV_SHARED_UBATCH=0 turns this off). A
// token that belongs to several sequences at once is refused (decode it per sequence, or copy with
// llama_memory_seq_cp).
class llama_kv_cache_poly_seqs : public llama_memory_i {
public:
    llama_kv_cache_poly_seqs(std::vector<std::unique_ptr<llama_kv_cache_poly>> seqs, uint32_t n_ctx_total);

    llama_memory_context_ptr init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) override;
    llama_memory_context_ptr init_full() override;
    llama_memory_context_ptr init_update(llama_context * lctx, bool optimize) override;

    bool get_can_shift() const override { return false; }

    void clear(bool data) override;

    bool seq_rm  (llama_seq_id seq_id,                              llama_pos p0, llama_pos p1) override;
    void seq_cp  (llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) override;
    void seq_keep(llama_seq_id seq_id)                                                          override;
    void seq_add (llama_seq_id seq_id,                              llama_pos p0, llama_pos p1, llama_pos shift) override;
    void seq_div (llama_seq_id seq_id,                              llama_pos p0, llama_pos p1, int d) override;

    llama_pos seq_pos_min(llama_seq_id seq_id) const override;
    llama_pos seq_pos_max(llama_seq_id seq_id) const override;

    std::map<ggml_backend_buffer_type_t, size_t> memory_breakdown() const override;

    void state_write(llama_io_write_i & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) const override;
    void state_read (llama_io_read_i  & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) override;

    uint32_t n_seq() const { return seqs.size(); }
    // the cache of sequence s (nullptr when out of range)
    llama_kv_cache_poly * get_seq(llama_seq_id s) const;
    // cells a stock cache of this context would hold (unified: n_ctx; one stream per sequence: n_seq x n_ctx_seq)
    uint32_t get_n_ctx_total() const { return n_ctx_total; }

    // ubatches that held decode steps of several sequences, and the tokens in them (llama_polykv_get_shared_ubatches)
    void count_shared(uint32_t n_tokens) { n_shared_ubatches += 1; n_shared_tokens += n_tokens; }
    int64_t shared_ubatches_done() const { return n_shared_ubatches; }
    int64_t shared_tokens_done() const { return n_shared_tokens; }

private:
    std::vector<std::unique_ptr<llama_kv_cache_poly>> seqs;
    const uint32_t n_ctx_total;
    const bool shared_ubatches; // LLAMA_POLYKV_SHARED_UBATCH (default on)
    int64_t n_shared_ubatches = 0;
    int64_t n_shared_tokens   = 0;
};

// in-memory llama_io: moving cells through the stock cache's own state format (compaction, resize, seq_cp)
class llama_polykv_io_write : public llama_io_write_i {
public:
    void write(const void * src, size_t size) override;
    void write_tensor(ggml_tensor * tensor, size_t offset, size_t size) override;
    size_t n_bytes() override { return buf.size(); }

    std::vector<uint8_t> buf;
};

class llama_polykv_io_read : public llama_io_read_i {
public:
    explicit llama_polykv_io_read(const std::vector<uint8_t> & buf) : buf(buf) {}
    void read(void * dst, size_t size) override;
    void read_tensor(ggml_tensor * tensor, size_t offset, size_t size) override;
    size_t n_bytes() override { return pos; }

private:
    const std::vector<uint8_t> & buf;
    size_t pos = 0;
};

// Expected Attention looks this many positions ahead (kvpress's n_future_positions)
#define LLAMA_POLYKV_EA_N_FUTURE 512

// graph input: one (idxs, mask) input per group, each over the group's own cache
class llm_graph_input_attn_kv_poly : public llm_graph_input_attn_kv {
public:
    llm_graph_input_attn_kv_poly(
            const llama_hparams & hparams,
            const llama_cparams & cparams,
            const llama_kv_cache_poly_context * pctx);

    void set_input(const llama_ubatch * ubatch) override;
    bool can_reuse(const llm_graph_params & params) override;

    llm_graph_input_attn_kv * group_input(int32_t il) const;

    const llama_kv_cache_poly_context * pctx;

    // per-head groups fill their mask input themselves ([n_kv, n_tokens, 1, n_head_kv], the group's kq mask);
    // nullptr for the others. Pooled groups: head_masks[g] is [n_kv*n_head_kv, n_tokens] and owner_masks[g]
    // [n_kv*n_head_kv, 1, n_head_kv], added into the kq mask [n_kv*n_head_kv, n_tokens*n_head_kv]
    std::vector<ggml_tensor *> head_masks;
    std::vector<ggml_tensor *> owner_masks;

    // what set_input fills for each group: the index inputs and the mask (a plain group's kq mask, else
    // head_masks[g]); the graph reads the group input's own tensors, which are the same unless packed
    std::vector<ggml_tensor *> in_k_idxs;
    std::vector<ggml_tensor *> in_v_idxs;
    std::vector<ggml_tensor *> in_masks;

    // with the caches off the host (a GPU, an RPC server), the scheduler copies every graph input to the device
    // on its own, each copy a synchronous transfer: one per group and kind is ~3 x n_layer transfers per token.
    // So a decode step's inputs of one type are packed into one graph input, copied once and viewed on the device;
    // set_input writes the members at their offsets in the packed host tensor (LLAMA_POLYKV_PACK_INPUTS=0/1
    // forces it for every ubatch)
    struct packed_input {
        ggml_tensor * packed = nullptr;
        std::vector<std::pair<ggml_tensor *, size_t>> members; // (tensor set_input fills, byte offset)
    };
    std::vector<packed_input> packs;

    // Expected Attention (some group needs query statistics): minus the ubatch's positions (I32 [n_tokens]: a
    // RoPE by -p undoes the one by p) and the positions as floats ([1, 1, n_tokens]: which queries count)
    ggml_tensor * ea_neg_pos = nullptr;
    ggml_tensor * ea_pos_f   = nullptr;

    std::vector<std::unique_ptr<llm_graph_input_attn_kv>> groups;

    // a ubatch of several sequences: no groups, one input per sequence for rows [i0, i0 + n) of the ubatch;
    // build_attn builds each one's attention on its own caches and concatenates the rows
    struct part {
        std::unique_ptr<llm_graph_input_attn_kv_poly> inp;
        uint32_t i0 = 0;
        uint32_t n  = 0;
    };
    std::vector<part> parts;

    // the cache's graph_key when the graph was built, and the score outputs it built for each group: set_input
    // hands them to the groups again when the graph is reused (the groups forget them once read)
    std::vector<int64_t> key;
    struct score_outputs {
        ggml_tensor * rows       = nullptr;
        ggml_tensor * rows_heads = nullptr;
        ggml_tensor * knorm      = nullptr;
        ggml_tensor * ea_sum     = nullptr;
        ggml_tensor * ea_sq      = nullptr;
    };
    mutable std::vector<score_outputs> outputs;
};

// the same for models whose graphs ask for iSWA inputs (gemma3): build_attn forwards to the per-group input
class llm_graph_input_attn_kv_iswa_poly : public llm_graph_input_attn_kv_iswa {
public:
    llm_graph_input_attn_kv_iswa_poly(
            const llama_hparams & hparams,
            const llama_cparams & cparams,
            std::unique_ptr<llm_graph_input_attn_kv_poly> kv);

    void set_input(const llama_ubatch * ubatch) override;
    bool can_reuse(const llm_graph_params & params) override;

    std::unique_ptr<llm_graph_input_attn_kv_poly> kv;
};

//
// hooks called from llama.cpp files (native/patches)
//

// llama_model::create_memory: the PolyKV memory if a plan applies to this model/context, else nullptr;
// throws std::runtime_error for a bad plan or an unsupported model
llama_memory_i * llama_polykv_create_memory(const llama_model & model, const llama_memory_params & params, const llama_cparams & cparams);

// llm_graph_context::build_attn_inp_kv / _iswa: one (idxs, mask) input per cache group
std::unique_ptr<llm_graph_input_attn_kv_poly> llama_polykv_build_input(
        ggml_context * ctx0,
        const llama_ubatch & ubatch,
        const llama_hparams & hparams,
        const llama_cparams & cparams,
        const llama_kv_cache_poly_context * pctx);

// llm_graph_context::build_attn: the score branch of layer il (no-op for layers without score patterns)
void llama_polykv_build_scores(
        ggml_context * ctx0,
         ggml_cgraph * gf,
        const llm_graph_input_attn_kv_poly * inp,
         ggml_tensor * q,
         ggml_tensor * k,
         ggml_tensor * k_cur,
         ggml_tensor * kq_mask,
               float   kq_scale,
             int32_t   il);

// llm_graph_context::build_attn, before the score branch: the K and V of a per-head group ([d, n_head_kv, n_kv] views
// of the cache) become its KV heads as streams ([d, 1, n_kv, n_head_kv]), those of a pooled group its slots as one KV
// head ([d, 1, n_kv*n_head_kv]); so a mask has one head slice (CUDA's flash attention takes no other); other layers
// keep theirs
void llama_polykv_view_kv(
        ggml_context * ctx0,
        const llm_graph_input_attn_kv_poly * inp,
             int32_t   il,
         ggml_tensor * & k,
         ggml_tensor * & v);

// llm_graph_context::build_attn, after the score branch: the queries of a per-head or pooled group as rows
// ([d, n_head/n_head_kv, n_tokens*n_head_kv], KV head g's query heads in the g-th block of n_tokens rows: the
// streams of build_attn_mha, or a pooled mask's rows), and the attention output put back in the model's head order;
// identities for other layers and for one KV head
ggml_tensor * llama_polykv_attn_q(ggml_context * ctx0, const llm_graph_input_attn_kv_poly * inp, int32_t il, ggml_tensor * q);
ggml_tensor * llama_polykv_attn_out(ggml_context * ctx0, const llm_graph_input_attn_kv_poly * inp, int32_t il, ggml_tensor * cur);

// llm_graph_context::build_attn with a ubatch of several sequences: rows [i0, i0 + n) of q, k or v ([d, heads, n_tokens])
ggml_tensor * llama_polykv_rows(ggml_context * ctx0, ggml_tensor * cur, uint32_t i0, uint32_t n);

// llama_context::graph_max_nodes: the nodes a graph may need beyond the stock count (attention once per sequence of
// a shared ubatch)
uint32_t llama_polykv_graph_extra_nodes(const llama_memory_i * mem, uint32_t n_layer);

// llama_model_free: forget the plan settings of a model (its address may be reused by the next model)
void llama_polykv_forget_model(const llama_model * model);

// llama_context::decode, after each computed ubatch; false (logged) if eviction failed: decode then fails as a
// failed graph computation does (-3)
bool llama_polykv_after_ubatch(llama_context * lctx, llama_memory_i * mem, const llama_ubatch & ubatch);
