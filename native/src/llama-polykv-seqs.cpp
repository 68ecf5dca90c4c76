// PolyKV with several sequences: one llama_kv_cache_poly per sequence (see llama_kv_cache_poly_seqs in
// llama-polykv.h and docs/design.md)

#include "llama-polykv.h"

#include "llama-impl.h"
#include "llama-batch.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

static bool shared_ubatches_enabled() {
    const char * env = getenv("LLAMA_POLYKV_SHARED_UBATCH");
    return !env || strcmp(env, "0") != 0;
}

llama_kv_cache_poly_seqs::llama_kv_cache_poly_seqs(std::vector<std::unique_ptr<llama_kv_cache_poly>> seqs, uint32_t n_ctx_total) :
    seqs(std::move(seqs)), n_ctx_total(n_ctx_total), shared_ubatches(shared_ubatches_enabled()) {
}

llama_kv_cache_poly * llama_kv_cache_poly_seqs::get_seq(llama_seq_id s) const {
    return s >= 0 && (size_t) s < seqs.size() ? seqs[s].get() : nullptr;
}

llama_memory_context_ptr llama_kv_cache_poly_seqs::init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) {
    GGML_UNUSED(embd_all);

    balloc.split_reset();

    // split_seq takes the tokens of the sequence whose first unused token comes first in the batch, in batch order;
    // the same walk here says which sequence that is, so that its ubatch ends where its prompt chunk ends
    const llama_batch & batch = balloc.get_batch();
    std::vector<std::vector<int32_t>> idxs(seqs.size());
    for (int32_t i = 0; i < batch.n_tokens; ++i) {
        if (batch.n_seq_id && batch.n_seq_id[i] != 1) {
            LLAMA_LOG_ERROR("%s: PolyKV: a token of the batch belongs to %d sequences; with a plan every sequence has caches "
                            "of its own: decode the token for each sequence, or decode it once and copy it with "
                            "llama_memory_seq_cp\n", __func__, batch.n_seq_id[i]);
            return std::make_unique<llama_kv_cache_poly_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
        }
        const llama_seq_id s = batch.seq_id ? batch.seq_id[i][0] : 0;
        if (!get_seq(s)) {
            LLAMA_LOG_ERROR("%s: PolyKV: sequence %d is out of range (n_seq_max %u)\n", __func__, s, n_seq());
            return std::make_unique<llama_kv_cache_poly_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
        }
        idxs[s].push_back(i);
    }
    std::vector<size_t>   n_taken(seqs.size(), 0);
    std::vector<llama_kv_cache_poly::feed_state> feed(seqs.size());
    for (size_t s = 0; s < seqs.size(); ++s) {
        feed[s] = seqs[s]->get_feed();
    }

    // decode steps (one token of a sequence, a decode step of it) share ubatches, so the weights are read once per step
    // for all of them, not once per sequence (attention still runs per sequence): a batch of decode steps only, or
    // decode steps that come first in a batch whose other tokens are prompts (llama-server adds its generating
    // slots' tokens before the prompts of the others); the prompts then take ubatches of their own
    int32_t n_steps = 0; // sequences whose only token is a decode step
    std::vector<char> is_step(seqs.size(), 0);
    for (size_t s = 0; s < seqs.size(); ++s) {
        if (idxs[s].empty()) {
            continue;
        }
        is_step[s] = idxs[s].size() == 1 && seqs[s]->shares_ubatch(batch.logits && batch.logits[idxs[s][0]], feed[s]);
        n_steps += is_step[s];
    }
    // the decode steps are exactly the batch's first n_steps tokens (split_simple takes them from there)
    bool steps_first = true;
    for (size_t s = 0; s < seqs.size() && steps_first; ++s) {
        steps_first = idxs[s].empty() || (is_step[s] ? idxs[s][0] < n_steps : idxs[s][0] >= n_steps);
    }
    const bool share = shared_ubatches && n_steps > 1 && steps_first;

    std::vector<llama_ubatch> ubatches;
    std::vector<llama_kv_cache_poly *> ubatch_kv;
    if (share) {
        uint32_t left = (uint32_t) n_steps;
        while (left > 0) {
            auto ubatch = balloc.split_simple(std::min<uint32_t>({ n_ubatch, (uint32_t) LLAMA_POLYKV_MAX_SHARED_SEQS, left }));
            if (ubatch.n_tokens == 0) {
                return std::make_unique<llama_kv_cache_poly_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
            }
            left -= ubatch.n_tokens;
            for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
                n_taken[ubatch.seq_id[i][0]] += 1;
            }
            // nullptr: a ubatch of several sequences (llama_kv_cache_poly_context::apply)
            ubatch_kv.push_back(ubatch.n_tokens == 1 ? get_seq(ubatch.seq_id[0][0]) : nullptr);
            ubatches.push_back(std::move(ubatch)); // NOLINT
        }
    }
    while (true) {
        int32_t next = -1;
        for (size_t s = 0; s < seqs.size(); ++s) {
            if (n_taken[s] < idxs[s].size() && (next < 0 || idxs[s][n_taken[s]] < idxs[next][n_taken[next]])) {
                next = (int32_t) s;
            }
        }
        if (next < 0) {
            break;
        }
        auto * poly = seqs[next].get();
        auto ubatch = balloc.split_seq(std::min(n_ubatch, poly->ubatch_room(feed[next]))); // the tokens of one sequence, in order
        if (ubatch.n_tokens == 0 || ubatch.seq_id[0][0] != next) {
            LLAMA_LOG_ERROR("%s: PolyKV: the batch was split in an unexpected order\n", __func__);
            return std::make_unique<llama_kv_cache_poly_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
        }
        n_taken[next] += ubatch.n_tokens;
        feed[next] = poly->feed_after(feed[next], ubatch);
        ubatch_kv.push_back(poly);
        ubatches.push_back(std::move(ubatch)); // NOLINT
    }

    if (ubatches.empty() || balloc.get_n_used() < balloc.get_n_tokens()) {
        return std::make_unique<llama_kv_cache_poly_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
    }

    return std::make_unique<llama_kv_cache_poly_context>(this, std::move(ubatch_kv), std::move(ubatches));
}

llama_memory_context_ptr llama_kv_cache_poly_seqs::init_full() {
    // every sequence's caches have the same layout: the worst-case graph of one serves all
    return seqs.front()->init_full();
}

llama_memory_context_ptr llama_kv_cache_poly_seqs::init_update(llama_context * lctx, bool optimize) {
    GGML_UNUSED(lctx);
    GGML_UNUSED(optimize);
    return std::make_unique<llama_kv_cache_poly_context>(LLAMA_MEMORY_STATUS_NO_UPDATE);
}

void llama_kv_cache_poly_seqs::clear(bool data) {
    for (auto & s : seqs) {
        s->clear(data);
    }
}

bool llama_kv_cache_poly_seqs::seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    if (seq_id < 0) {
        bool res = true;
        for (auto & s : seqs) {
            res = s->seq_rm(s->get_seq(), p0, p1) && res;
        }
        return res;
    }
    auto * poly = get_seq(seq_id);
    return poly ? poly->seq_rm(seq_id, p0, p1) : false;
}

// the destination holds what the source's layers keep of [p0, p1) afterwards (what it held before is replaced):
// the source's cells and score state move through the state format, so the copy evicts as the source would
void llama_kv_cache_poly_seqs::seq_cp(llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) {
    auto * src = get_seq(seq_id_src);
    auto * dst = get_seq(seq_id_dst);
    if (!src || !dst || src == dst) {
        return;
    }
    try {
        llama_polykv_io_write w;
        src->state_write(w, seq_id_src);
        llama_polykv_io_read r(w.buf);
        dst->seq_rm(seq_id_dst, -1, -1);
        dst->state_read(r, seq_id_dst);
        if (p0 > 0) {
            dst->seq_rm(seq_id_dst, 0, p0);
        }
        if (p1 >= 0) {
            dst->seq_rm(seq_id_dst, p1, -1);
        }
    } catch (const std::exception & e) {
        LLAMA_LOG_ERROR("%s: PolyKV: copying sequence %d to %d failed: %s\n", __func__, seq_id_src, seq_id_dst, e.what());
        dst->seq_rm(seq_id_dst, -1, -1);
    }
}

void llama_kv_cache_poly_seqs::seq_keep(llama_seq_id seq_id) {
    for (auto & s : seqs) {
        if (s->get_seq() != seq_id) {
            s->clear(true);
        }
    }
}

void llama_kv_cache_poly_seqs::seq_add(llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) {
    seqs.front()->seq_add(seq_id, p0, p1, shift); // not supported: warns
}

void llama_kv_cache_poly_seqs::seq_div(llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) {
    seqs.front()->seq_div(seq_id, p0, p1, d); // not supported: warns
}

llama_pos llama_kv_cache_poly_seqs::seq_pos_min(llama_seq_id seq_id) const {
    const auto * poly = get_seq(seq_id);
    return poly ? poly->seq_pos_min(seq_id) : -1;
}

llama_pos llama_kv_cache_poly_seqs::seq_pos_max(llama_seq_id seq_id) const {
    const auto * poly = get_seq(seq_id);
    return poly ? poly->seq_pos_max(seq_id) : -1;
}

std::map<ggml_backend_buffer_type_t, size_t> llama_kv_cache_poly_seqs::memory_breakdown() const {
    std::map<ggml_backend_buffer_type_t, size_t> mb;
    for (const auto & s : seqs) {
        for (const auto & [buft, size] : s->memory_breakdown()) {
            mb[buft] += size;
        }
    }
    return mb;
}

static const uint32_t POLYKV_SEQS_STATE_MAGIC = 0x504b5353; // "PKSS"

// the whole context: every sequence's cache in turn; one sequence: that sequence's cache alone (a slot's state
// loads into any sequence of a context with the same plan)
void llama_kv_cache_poly_seqs::state_write(llama_io_write_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) const {
    if (seq_id >= 0) {
        const auto * poly = get_seq(seq_id);
        if (!poly) {
            throw std::runtime_error("PolyKV: no sequence " + std::to_string(seq_id) + " in this context");
        }
        poly->state_write(io, seq_id, flags);
        return;
    }
    const uint32_t n = seqs.size();
    io.write(&POLYKV_SEQS_STATE_MAGIC, sizeof(POLYKV_SEQS_STATE_MAGIC));
    io.write(&n, sizeof(n));
    for (const auto & s : seqs) {
        s->state_write(io, -1, flags);
    }
}

void llama_kv_cache_poly_seqs::state_read(llama_io_read_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) {
    if (seq_id >= 0) {
        auto * poly = get_seq(seq_id);
        if (!poly) {
            throw std::runtime_error("PolyKV: no sequence " + std::to_string(seq_id) + " in this context");
        }
        poly->state_read(io, seq_id, flags);
        return;
    }
    uint32_t magic = 0;
    uint32_t n = 0;
    io.read(&magic, sizeof(magic));
    io.read(&n, sizeof(n));
    if (magic != POLYKV_SEQS_STATE_MAGIC || n != seqs.size()) {
        throw std::runtime_error("PolyKV: the saved state is not one of " + std::to_string(seqs.size()) +
                                 " sequences with a plan (saved with another n_seq_max, plan or model)");
    }
    for (auto & s : seqs) {
        s->state_read(io, -1, flags);
    }
}
