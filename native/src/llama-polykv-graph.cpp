// PolyKV: graph inputs (one index/mask input per cache group; per-head groups: a mask slice per KV head, which the
// attention reads with the KV heads as streams) and the score branch of the attention-based patterns

#include "llama-polykv.h"

#include "llama-cparams.h"
#include "llama-impl.h"

#include <cmath>
#include <cstdlib>

void llama_kv_cache_poly::set_input_kq_mask_heads(uint32_t g, ggml_tensor * dst, const llama_ubatch * ubatch) const {
    const auto & grp = groups[g];
    GGML_ASSERT(grp.per_head && ggml_backend_buffer_is_host(dst->buffer));
    const uint32_t nh = grp.n_head_kv;
    // pooled: one slice over the slots (j = c*n_head_kv + s), which set_input_owner_mask splits by owner
    const int64_t n_cols = dst->ne[0];
    const int64_t n_tokens = dst->ne[1];
    const uint32_t n_slices = grp.pooled ? 1 : nh;
    GGML_ASSERT(dst->ne[2] == 1 && dst->ne[3] == (int64_t) n_slices && n_tokens == (int64_t) ubatch->n_tokens);
    const uint32_t cap = grp.capacity;
    const uint32_t n_swa = grp.is_swa ? hparams.n_swa : 0;
    const bool f16 = dst->type == GGML_TYPE_F16;
    const ggml_fp16_t keep_f16 = ggml_fp32_to_fp16(0.0f);
    const ggml_fp16_t drop_f16 = ggml_fp32_to_fp16(-INFINITY);
    for (uint32_t h = 0; h < n_slices; ++h) {
        for (int64_t i = 0; i < n_tokens; ++i) {
            const llama_pos p1 = ubatch->pos[i];
            char * row = (char *) dst->data + i*dst->nb[1] + h*dst->nb[3];
            for (int64_t j = 0; j < n_cols; ++j) {
                const int64_t c = grp.pooled ? j / nh : j;
                const int64_t u = grp.pooled ? (j % nh)*cap + c : (int64_t) h*cap + c;
                const llama_pos p0 = c < (int64_t) cap ? grp.hpos[u] : -1;
                const bool visible = p0 >= 0 && p0 <= p1 && (n_swa == 0 || p1 - p0 < (llama_pos) n_swa);
                if (f16) {
                    ((ggml_fp16_t *) row)[j] = visible ? keep_f16 : drop_f16;
                } else {
                    ((float *) row)[j] = visible ? 0.0f : -INFINITY;
                }
            }
        }
    }
}

void llama_kv_cache_poly::set_input_owner_mask(uint32_t g, ggml_tensor * dst) const {
    const auto & grp = groups[g];
    const uint32_t nh = grp.n_head_kv;
    GGML_ASSERT(grp.pooled && ggml_backend_buffer_is_host(dst->buffer));
    GGML_ASSERT(dst->ne[1] == 1 && dst->ne[2] == (int64_t) nh && dst->ne[3] == 1 && dst->ne[0] % nh == 0);
    const int64_t n_cols = dst->ne[0];
    const uint32_t cap = grp.capacity;
    const bool f16 = dst->type == GGML_TYPE_F16;
    const ggml_fp16_t keep_f16 = ggml_fp32_to_fp16(0.0f);
    const ggml_fp16_t drop_f16 = ggml_fp32_to_fp16(-INFINITY);
    for (uint32_t h = 0; h < nh; ++h) {
        char * row = (char *) dst->data + h*dst->nb[2];
        for (int64_t j = 0; j < n_cols; ++j) {
            const int64_t c = j / nh;
            const size_t u = (j % nh)*cap + c;
            const bool own = c < (int64_t) cap && grp.hpos[u] >= 0 && grp.howner[u] == h;
            if (f16) {
                ((ggml_fp16_t *) row)[j] = own ? keep_f16 : drop_f16;
            } else {
                ((float *) row)[j] = own ? 0.0f : -INFINITY;
            }
        }
    }
}

//
// graph input
//

llm_graph_input_attn_kv_poly::llm_graph_input_attn_kv_poly(
        const llama_hparams & hparams,
        const llama_cparams & cparams,
        const llama_kv_cache_poly_context * pctx) :
    llm_graph_input_attn_kv(hparams, cparams, pctx->n_parts() > 0 ? pctx->get_part(0)->get_group(0) : pctx->get_group(0)), pctx(pctx) {
}

void llm_graph_input_attn_kv_poly::set_input(const llama_ubatch * ubatch) {
    if (!parts.empty()) {
        for (size_t i = 0; i < parts.size(); ++i) {
            parts[i].inp->set_input(&pctx->get_part(i)->get_ubatch());
        }
        return;
    }
    if (ea_neg_pos && ea_neg_pos->buffer) {
        std::vector<int32_t> neg(ubatch->n_tokens);
        for (uint32_t i = 0; i < ubatch->n_tokens; ++i) {
            neg[i] = -ubatch->pos[i];
        }
        ggml_backend_tensor_set(ea_neg_pos, neg.data(), 0, neg.size() * sizeof(int32_t));
    }
    if (ea_pos_f && ea_pos_f->buffer) {
        std::vector<float> pf(ubatch->n_tokens);
        for (uint32_t i = 0; i < ubatch->n_tokens; ++i) {
            pf[i] = (float) ubatch->pos[i];
        }
        ggml_backend_tensor_set(ea_pos_f, pf.data(), 0, pf.size() * sizeof(float));
    }
    auto * poly = pctx->get_poly();
    for (size_t g = 0; g < groups.size(); ++g) {
        // a reused graph computes the same outputs again: the group reads them after this ubatch
        auto & grp = poly->get_group(g);
        grp.t_rows       = outputs[g].rows;
        grp.t_rows_heads = outputs[g].rows_heads;
        grp.t_knorm      = outputs[g].knorm;
        grp.t_ea_sum     = outputs[g].ea_sum;
        grp.t_ea_sq      = outputs[g].ea_sq;
    }
    for (const auto & pk : packs) {
        // the members are not graph tensors: they live at their offsets in the packed input, if this graph has it
        for (const auto & m : pk.members) {
            m.first->buffer = pk.packed->buffer;
            m.first->data   = pk.packed->buffer ? (char *) pk.packed->data + m.second : nullptr;
        }
    }
    for (size_t g = 0; g < groups.size(); ++g) {
        auto & inp = groups[g];
        if (in_k_idxs[g] && in_k_idxs[g]->buffer) {
            inp->mctx->set_input_k_idxs(in_k_idxs[g], ubatch);
        }
        if (in_v_idxs[g] && in_v_idxs[g]->buffer) {
            inp->mctx->set_input_v_idxs(in_v_idxs[g], ubatch);
        }
        if (in_masks[g] && in_masks[g]->buffer) {
            if (head_masks[g]) {
                // per-head group: a mask of our own
                poly->set_input_kq_mask_heads(g, in_masks[g], ubatch);
            } else {
                inp->mctx->set_input_kq_mask(in_masks[g], ubatch, cparams.causal_attn);
            }
        }
        if (owner_masks[g] && owner_masks[g]->buffer) {
            poly->set_input_owner_mask(g, owner_masks[g]);
        }
        if (inp->self_k_rot && inp->self_k_rot->buffer) {
            inp->mctx->set_input_k_rot(inp->self_k_rot);
        }
        if (inp->self_v_rot && inp->self_v_rot->buffer) {
            inp->mctx->set_input_v_rot(inp->self_v_rot);
        }
    }
}

bool llm_graph_input_attn_kv_poly::can_reuse(const llm_graph_params & params) {
    const auto * pnew = dynamic_cast<const llama_kv_cache_poly_context *>(params.mctx);
    if (!parts.empty()) {
        // a ubatch of several sequences: the same sequences in the same rows, each part reusable
        if (!pnew || pnew->n_parts() != parts.size()) {
            return false;
        }
        for (size_t i = 0; i < parts.size(); ++i) {
            llm_graph_params pp = params;
            pp.mctx   = pnew->get_part(i);
            pp.ubatch = pnew->get_part(i)->get_ubatch();
            if (pp.ubatch.n_tokens != parts[i].n || !parts[i].inp->can_reuse(pp)) {
                return false;
            }
        }
        pctx = pnew;
        mctx = pnew->get_part(0)->get_group(0);
        return true;
    }
    if (!pnew || pnew->n_groups() != groups.size() || pnew->get_poly()->graph_key(pnew->is_batch()) != key) {
        return false; // another sequence's caches, a replaced group cache, or another score branch
    }
    // the same as the stock input's check, for every group: the ubatch's tokens and the group's n_kv
    pctx = pnew;
    mctx = pnew->get_group(0);
    const int64_t n_tokens = params.ubatch.n_tokens;
    bool res = true;
    for (size_t g = 0; g < groups.size(); ++g) {
        auto & inp = groups[g];
        inp->mctx = pnew->get_group(g);
        // pooled: [n_kv*n_head_kv, n_tokens*n_head_kv]; per head: [n_kv, n_tokens, 1, n_head_kv]
        const ggml_tensor * mask = inp->self_kq_mask;
        const int64_t nh_pooled = owner_masks[g] ? owner_masks[g]->ne[2] : 1;
        const int64_t nh_streams = head_masks[g] && !owner_masks[g] ? head_masks[g]->ne[3] : 1;
        res &= inp->self_k_idxs->ne[0] == n_tokens;
        res &= mask->ne[0] == (int64_t) inp->mctx->get_n_kv() * nh_pooled && mask->ne[1] == n_tokens * nh_pooled;
        res &= mask->ne[2] == 1 && mask->ne[3] == nh_streams;
    }
    return res;
}

llm_graph_input_attn_kv * llm_graph_input_attn_kv_poly::group_input(int32_t il) const {
    const int32_t g = pctx->get_poly()->group_of(il);
    GGML_ASSERT(g >= 0);
    return groups[g].get();
}

llm_graph_input_attn_kv_iswa_poly::llm_graph_input_attn_kv_iswa_poly(
        const llama_hparams & hparams,
        const llama_cparams & cparams,
        std::unique_ptr<llm_graph_input_attn_kv_poly> kv) :
    llm_graph_input_attn_kv_iswa(hparams, cparams, nullptr), kv(std::move(kv)) {
}

void llm_graph_input_attn_kv_iswa_poly::set_input(const llama_ubatch * ubatch) {
    kv->set_input(ubatch);
}

bool llm_graph_input_attn_kv_iswa_poly::can_reuse(const llm_graph_params & params) {
    return kv->can_reuse(params);
}

// ubatches of at most this many tokens pack their inputs by default: decode steps (also speculative and shared
// ones), whose dozens of copies cost more than their compute. A prompt ubatch's copies are few against its
// compute, and packing would hold its masks twice on the device (the copied input and the packed op's result)
#define LLAMA_POLYKV_PACK_MAX_TOKENS 64

// LLAMA_POLYKV_PACK_INPUTS: 1 packs the graph inputs of the groups (llm_graph_input_attn_kv_poly::packs) whatever
// the backend and the ubatch, 0 never; unset: small ubatches when every group's cache is off the host
static bool should_pack_inputs(const llama_kv_cache_poly & poly, uint32_t n_tokens) {
    const char * env = getenv("LLAMA_POLYKV_PACK_INPUTS"); // read each time: a test switches it within one process
    if (env && *env) {
        return atoi(env) != 0;
    }
    bool off_host = poly.n_groups() > 0 && n_tokens <= LLAMA_POLYKV_PACK_MAX_TOKENS;
    for (uint32_t g = 0; g < poly.n_groups(); ++g) {
        for (int32_t il : poly.get_group(g).layers) {
            const ggml_tensor * k = poly.get_group(g).kv->get_k_storage(il);
            off_host &= k && k->buffer && !ggml_backend_buffer_is_host(k->buffer);
        }
    }
    return off_host; // partly offloaded: the host layers would read the device's copy back
}

// one graph input holding the given tensors of one type at aligned offsets, and an op on it that the scheduler
// places with the tensors' readers (a copy within the device): *t becomes a view of that op's result, and the
// tensor it was becomes a member that set_input fills inside the packed input
static llm_graph_input_attn_kv_poly::packed_input pack_inputs(ggml_context * ctx0, const std::vector<ggml_tensor **> & ts) {
    const size_t align = 256; // as a device buffer's; the kernels load masks and indices in wide words
    const ggml_type type = (*ts.front())->type;
    std::vector<size_t> offs;
    size_t total = 0;
    for (ggml_tensor ** t : ts) {
        GGML_ASSERT((*t)->type == type && ggml_is_contiguous(*t));
        offs.push_back(total);
        total += GGML_PAD(ggml_nbytes(*t), align);
    }
    llm_graph_input_attn_kv_poly::packed_input res;
    res.packed = ggml_new_tensor_1d(ctx0, type, (int64_t) (total / ggml_type_size(type)));
    ggml_set_input(res.packed);
    ggml_set_name(res.packed, "polykv_inp_packed");
    ggml_tensor * dev = ggml_cont(ctx0, res.packed);
    for (size_t i = 0; i < ts.size(); ++i) {
        ggml_tensor * t = *ts[i];
        res.members.push_back({ t, offs[i] });
        *ts[i] = ggml_view_4d(ctx0, dev, t->ne[0], t->ne[1], t->ne[2], t->ne[3], t->nb[1], t->nb[2], t->nb[3], offs[i]);
        ggml_set_name(*ts[i], t->name);
    }
    return res;
}

std::unique_ptr<llm_graph_input_attn_kv_poly> llama_polykv_build_input(
        ggml_context * ctx0,
        const llama_ubatch & ubatch,
        const llama_hparams & hparams,
        const llama_cparams & cparams,
        const llama_kv_cache_poly_context * pctx) {
    auto inp = std::make_unique<llm_graph_input_attn_kv_poly>(hparams, cparams, pctx);
    if (pctx->n_parts() > 0) {
        // a ubatch of several sequences: an input of its own for each sequence's rows
        uint32_t i0 = 0;
        for (uint32_t i = 0; i < pctx->n_parts(); ++i) {
            const auto * part = pctx->get_part(i);
            const uint32_t n = part->get_ubatch().n_tokens;
            inp->parts.push_back({ llama_polykv_build_input(ctx0, part->get_ubatch(), hparams, cparams, part), i0, n });
            i0 += n;
        }
        GGML_ASSERT(i0 == ubatch.n_tokens);
        return inp;
    }
    inp->key = pctx->get_poly()->graph_key(pctx->is_batch());
    inp->outputs.resize(pctx->n_groups());
    // every group cache is one stream: with several sequences each sequence has its own caches and a ubatch holds
    // one sequence (llama_kv_cache_poly_seqs)
    const int64_t n_stream = 1;
    std::vector<ggml_tensor *> pooled_pos(pctx->n_groups(), nullptr); // what the graph reads of a pooled group's masks
    std::vector<ggml_tensor *> pooled_own(pctx->n_groups(), nullptr);
    for (uint32_t g = 0; g < pctx->n_groups(); ++g) {
        const auto * gctx = pctx->get_group(g);
        auto ginp = std::make_unique<llm_graph_input_attn_kv>(hparams, cparams, gctx);
        ginp->self_k_idxs = gctx->build_input_k_idxs(ctx0, ubatch);
        ginp->self_v_idxs = gctx->build_input_v_idxs(ctx0, ubatch);
        // flash attention wants an f16 mask
        const auto & grp = pctx->get_poly()->get_group(g);
        const ggml_type mask_type = cparams.flash_attn ? GGML_TYPE_F16 : GGML_TYPE_F32;
        const int64_t n_kv = gctx->get_n_kv();
        ggml_tensor * mask = nullptr;
        if (grp.pooled) {
            // the slots as one KV head (llama_polykv_view_kv) and every query row once per KV head (row t of KV head
            // g is row t + g*n_tokens, llama_polykv_attn_q): a slot is seen by row (t, g) if its position is visible
            // from t (the input, one slice) and g owns it (a small second input); the kq mask is built below
            GGML_ASSERT(n_stream == 1);
            const int64_t nh = grp.n_head_kv;
            mask = ggml_new_tensor_4d(ctx0, mask_type, n_kv*nh, ubatch.n_tokens, 1, 1);
            ggml_set_input(mask);
            ggml_set_name(mask, "attn_inp_kq_mask_slots");
            ggml_tensor * mask_own = ggml_new_tensor_4d(ctx0, mask_type, n_kv*nh, 1, nh, 1);
            ggml_set_input(mask_own);
            ggml_set_name(mask_own, "attn_inp_kq_mask_owners");
            inp->head_masks.push_back(mask);
            inp->owner_masks.push_back(mask_own);
            pooled_pos[g] = mask;
            pooled_own[g] = mask_own;
        } else if (grp.per_head) {
            // one mask slice per KV head ([n_kv, n_tokens, 1, n_head_kv]): the attention takes the KV heads as
            // streams (llama_polykv_view_kv), so that a mask has one head slice, as the CUDA kernels need
            GGML_ASSERT(n_stream == 1);
            mask = ggml_new_tensor_4d(ctx0, mask_type, n_kv, ubatch.n_tokens, 1, grp.n_head_kv);
            ggml_set_input(mask);
            ggml_set_name(mask, "attn_inp_kq_mask");
            inp->head_masks.push_back(mask);
            inp->owner_masks.push_back(nullptr);
            ginp->self_kq_mask = mask;
        } else {
            mask = ggml_new_tensor_4d(ctx0, mask_type, n_kv, ubatch.n_tokens/n_stream, 1, n_stream);
            ggml_set_input(mask);
            ggml_set_name(mask, "attn_inp_kq_mask");
            inp->head_masks.push_back(nullptr);
            inp->owner_masks.push_back(nullptr);
            ginp->self_kq_mask = mask;
        }
        inp->in_k_idxs.push_back(ginp->self_k_idxs);
        inp->in_v_idxs.push_back(ginp->self_v_idxs);
        inp->in_masks.push_back(mask);
        ginp->self_k_rot = gctx->build_input_k_rot(ctx0);
        ginp->self_v_rot = gctx->build_input_v_rot(ctx0);
        inp->groups.push_back(std::move(ginp));
        if (!grp.ea_sum.empty() && !inp->ea_neg_pos) {
            inp->ea_neg_pos = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, ubatch.n_tokens);
            ggml_set_input(inp->ea_neg_pos);
            inp->ea_pos_f = ggml_new_tensor_3d(ctx0, GGML_TYPE_F32, 1, 1, ubatch.n_tokens);
            ggml_set_input(inp->ea_pos_f);
        }
    }
    if (should_pack_inputs(*pctx->get_poly(), ubatch.n_tokens)) {
        // the tensors the graph reads, by type (indices I64, masks F16 or F32)
        std::vector<std::vector<ggml_tensor **>> by_type;
        auto add = [&](ggml_tensor ** t) {
            if (!*t) {
                return;
            }
            for (auto & v : by_type) {
                if ((*v.front())->type == (*t)->type) {
                    v.push_back(t);
                    return;
                }
            }
            by_type.push_back({ t });
        };
        for (uint32_t g = 0; g < pctx->n_groups(); ++g) {
            auto & ginp = inp->groups[g];
            add(&ginp->self_k_idxs);
            add(&ginp->self_v_idxs);
            if (pooled_pos[g]) {
                add(&pooled_pos[g]);
                add(&pooled_own[g]);
            } else {
                add(&ginp->self_kq_mask);
            }
        }
        for (auto & members : by_type) {
            inp->packs.push_back(pack_inputs(ctx0, members));
        }
        auto * poly = pctx->get_poly();
        if (!poly->inputs_pack_logged) {
            LLAMA_LOG_INFO("%s: PolyKV: the graph inputs of %u cache groups are packed into %zu (one copy each to the "
                           "device per ubatch)\n", __func__, pctx->n_groups(), inp->packs.size());
            poly->inputs_pack_logged = true;
        }
    }
    for (uint32_t g = 0; g < pctx->n_groups(); ++g) {
        auto & ginp = inp->groups[g];
        if (pooled_pos[g]) {
            const int64_t nh = pooled_own[g]->ne[2];
            const int64_t n_cols = pooled_pos[g]->ne[0];
            ggml_tensor * mask = ggml_add(ctx0, ggml_repeat_4d(ctx0, pooled_pos[g], n_cols, ubatch.n_tokens, nh, 1),
                                          pooled_own[g]);
            ginp->self_kq_mask = ggml_reshape_2d(ctx0, mask, n_cols, ubatch.n_tokens*nh);
        }
        ginp->self_kq_mask_cnv = ginp->self_kq_mask;
    }
    return inp;
}

void llama_polykv_view_kv(
        ggml_context * ctx0,
        const llm_graph_input_attn_kv_poly * inp,
             int32_t   il,
         ggml_tensor * & k,
         ggml_tensor * & v) {
    const auto * poly = inp->pctx->get_poly();
    const auto & grp = poly->get_group(poly->group_of(il));
    if (!grp.heads_apart()) {
        return;
    }
    // k, v: [d, n_head_kv, n_kv] views of rows of n_head_kv heads (V transposed: [n_kv, n_head_kv, d])
    const int64_t nh = grp.n_head_kv;
    GGML_ASSERT(k->ne[1] == nh && v->ne[1] == nh && k->ne[3] == 1 && v->ne[3] == 1);
    if (grp.pooled) {
        // the slot (c, s) is row c*n_head_kv + s of d values: one KV head of n_kv*n_head_kv rows
        GGML_ASSERT(k->nb[2] == k->ne[1]*k->nb[1] && v->nb[2] == v->ne[1]*v->nb[1]); // rows without gaps, V not transposed
        const int64_t n_slots = k->ne[1] * k->ne[2];
        k = ggml_view_3d(ctx0, k, k->ne[0], 1, n_slots, k->nb[1], k->nb[1], 0);
        v = ggml_view_3d(ctx0, v, v->ne[0], 1, n_slots, v->nb[1], v->nb[1], 0);
        return;
    }
    // the KV heads as streams: [d, 1, n_kv, n_head_kv] (V transposed: [n_kv, 1, d, n_head_kv]); build_attn_mha splits
    // the queries into as many streams (llama_polykv_attn_q)
    k = ggml_view_4d(ctx0, k, k->ne[0], 1, k->ne[2], nh, k->nb[1], k->nb[2], k->nb[1], 0);
    v = ggml_view_4d(ctx0, v, v->ne[0], 1, v->ne[2], nh, v->nb[1], v->nb[2], v->nb[1], 0);
}

// [d, n_head, n_tokens] -> [d, n_head/n_head_kv, n_tokens*n_head_kv]: the query heads of KV head g (heads g*rk ..
// g*rk + rk - 1) as the rows g*n_tokens .. (g + 1)*n_tokens - 1, or back (to_kv_rows false)
static ggml_tensor * heads_to_rows(ggml_context * ctx0, ggml_tensor * x, int64_t n_head, int64_t nh, bool to_kv_rows) {
    const int64_t d = x->ne[0];
    const int64_t rk = n_head / nh;
    if (to_kv_rows) {
        const int64_t n_tokens = x->ne[2];
        ggml_tensor * x4 = ggml_view_4d(ctx0, x, d, rk, nh, n_tokens, x->nb[1], x->nb[1]*rk, x->nb[2], 0);
        return ggml_reshape_3d(ctx0, ggml_cont(ctx0, ggml_permute(ctx0, x4, 0, 1, 3, 2)), d, rk, n_tokens*nh);
    }
    const int64_t n_tokens = x->ne[2] / nh;
    ggml_tensor * x4 = ggml_reshape_4d(ctx0, x, d, rk, n_tokens, nh);
    return ggml_reshape_3d(ctx0, ggml_cont(ctx0, ggml_permute(ctx0, x4, 0, 1, 3, 2)), d, n_head, n_tokens);
}

ggml_tensor * llama_polykv_attn_q(ggml_context * ctx0, const llm_graph_input_attn_kv_poly * inp, int32_t il, ggml_tensor * q) {
    const auto * poly = inp->pctx->get_poly();
    const auto & grp = poly->get_group(poly->group_of(il));
    if (!grp.heads_apart()) {
        return q;
    }
    GGML_ASSERT(q->ne[1] % grp.n_head_kv == 0 && q->ne[3] == 1);
    return heads_to_rows(ctx0, q, q->ne[1], grp.n_head_kv, true);
}

ggml_tensor * llama_polykv_attn_out(ggml_context * ctx0, const llm_graph_input_attn_kv_poly * inp, int32_t il, ggml_tensor * cur) {
    const auto * poly = inp->pctx->get_poly();
    const auto & grp = poly->get_group(poly->group_of(il));
    if (!grp.heads_apart()) {
        return cur;
    }
    // cur: [d*rk, n_tokens*n_head_kv], the rows of llama_polykv_attn_q
    const int64_t n_head = inp->hparams.n_head(il);
    const int64_t nh = grp.n_head_kv;
    const int64_t rk = n_head / nh;
    GGML_ASSERT(ggml_n_dims(cur) <= 2 && cur->ne[0] % rk == 0 && cur->ne[1] % nh == 0);
    ggml_tensor * x = ggml_reshape_3d(ctx0, cur, cur->ne[0] / rk, rk, cur->ne[1]);
    x = heads_to_rows(ctx0, x, n_head, nh, false);
    return ggml_reshape_2d(ctx0, x, x->ne[0]*n_head, x->ne[2]);
}

ggml_tensor * llama_polykv_rows(ggml_context * ctx0, ggml_tensor * cur, uint32_t i0, uint32_t n) {
    GGML_ASSERT(ggml_n_dims(cur) <= 3 && i0 + n <= cur->ne[2]);
    if (i0 == 0 && n == cur->ne[2]) {
        return cur;
    }
    return ggml_view_3d(ctx0, cur, cur->ne[0], cur->ne[1], n, cur->nb[1], cur->nb[2], i0*cur->nb[2]);
}

void llama_polykv_build_scores(
        ggml_context * ctx0,
         ggml_cgraph * gf,
        const llm_graph_input_attn_kv_poly * inp,
         ggml_tensor * q,
         ggml_tensor * k,
         ggml_tensor * k_cur,
         ggml_tensor * kq_mask,
               float   kq_scale,
             int32_t   il) {
    auto * poly = inp->pctx->get_poly();
    auto & grp = poly->get_group(poly->group_of(il));
    auto & outs = inp->outputs[poly->group_of(il)];
    const bool record = inp->pctx->is_batch();
    const int64_t n_tokens = q->ne[2];
    // a KVzip reconstruction pass scores only the KVzip layers, with every query row
    const bool kvzip = poly->kvzip_pass() && record;
    if (kvzip && !grp.needs(LLAMA_POLYKV_KVZIP)) {
        return;
    }

    if (grp.needs(LLAMA_POLYKV_KNORM) && !kvzip) {
        ggml_tensor * kc = ggml_cont(ctx0, k_cur);                              // [d, n_head_kv, n_tokens]
        ggml_tensor * sq = ggml_sum_rows(ctx0, ggml_sqr(ctx0, kc));             // [1, n_head_kv, n_tokens]
        ggml_set_output(sq);
        ggml_build_forward_expand(gf, sq);
        grp.t_knorm = outs.knorm = record ? sq : nullptr;
    }
    if (!kvzip && !grp.ea_sum.empty() && inp->ea_neg_pos) {
        // Expected Attention: moments of the pre-RoPE queries, those at positions >= n_sink (kvpress leaves the first
        // n_sink out); RoPE by -p undoes the rotation by p
        const auto & rp = grp.rope;
        const auto & cp = inp->cparams;
        grp.ea_kq_scale = kq_scale;
        ggml_tensor * qc = ggml_is_contiguous(q) ? q : ggml_cont(ctx0, q);
        ggml_tensor * q_pre = ggml_rope_ext(ctx0, qc, inp->ea_neg_pos, nullptr, rp.n_rot, rp.mode, cp.n_ctx_orig_yarn,
                                            rp.freq_base, rp.freq_scale, cp.yarn_ext_factor, cp.yarn_attn_factor,
                                            cp.yarn_beta_fast, cp.yarn_beta_slow);             // [d, n_head, n_tokens]
        ggml_tensor * w = ggml_step(ctx0, ggml_scale_bias(ctx0, inp->ea_pos_f, 1.0f,
                                                          0.5f - (float) llama_kv_cache_poly::ea_n_sink(grp)));
        ggml_tensor * x = ggml_cont(ctx0, ggml_permute(ctx0, ggml_mul(ctx0, q_pre, w), 1, 2, 0, 3)); // [n_tokens, d, n_head]
        ggml_tensor * s1 = ggml_sum_rows(ctx0, x);                                      // [1, d, n_head]
        ggml_tensor * s2 = ggml_mul_mat(ctx0, x, x);                                    // [d, d, n_head]
        ggml_mul_mat_set_prec(s2, GGML_PREC_F32);
        ggml_set_output(s1);
        ggml_set_output(s2);
        ggml_build_forward_expand(gf, s1);
        ggml_build_forward_expand(gf, s2);
        grp.t_ea_sum = outs.ea_sum = record ? s1 : nullptr;
        grp.t_ea_sq  = outs.ea_sq  = record ? s2 : nullptr;
    }
    if (kvzip ? !grp.needs(LLAMA_POLYKV_KVZIP) : !grp.needs_rows() || (grp.rows_idle && record)) {
        return;
    }

    // which query rows the patterns read: all (H2O, a KVzip pass), the observation window (SnapKV), the last (TOVA)
    int64_t n_rows = 1;
    if (kvzip || grp.needs(LLAMA_POLYKV_H2O)) {
        n_rows = n_tokens;
    } else {
        n_rows = std::max<int64_t>(1, grp.ring_size());
    }
    n_rows = std::min(n_rows, n_tokens);

    const int64_t n_head = q->ne[1];
    // a pooled group's k is its slots as one KV head: a slot's probabilities come from its owner's query heads only
    // (the mask hides it from the others), so its KV head's sum is the sum over every query head
    GGML_ASSERT(!grp.pooled || !grp.layer_scores());
    const int64_t rk_sum = grp.pooled ? n_head : n_head / grp.n_head_kv;
    ggml_tensor * qs = ggml_view_3d(ctx0, q, q->ne[0], q->ne[1], n_rows, q->nb[1], q->nb[2], (n_tokens - n_rows)*q->nb[2]);
    ggml_tensor * ks = ggml_permute(ctx0, k, 0, 2, 1, 3); // [d, n_kv, n_head_kv] (streams: [d, n_kv, 1, n_head_kv])
    ggml_tensor * m = nullptr;
    if (grp.heads_apart()) {
        // the KV heads as streams, as the attention (llama_polykv_view_kv): the query heads of KV head g and its
        // mask slice in stream g; a pooled mask is [n_slots, n_tokens*n_head_kv], KV head g's rows the g-th block
        const int64_t nh = grp.n_head_kv;
        const int64_t rk = n_head / nh;
        qs = ggml_view_4d(ctx0, qs, qs->ne[0], rk, nh, n_rows, qs->nb[1], qs->nb[1]*rk, qs->nb[2], 0);
        qs = ggml_permute(ctx0, qs, 0, 2, 3, 1);                               // [d, n_rows, rk, n_head_kv]
        const size_t nb_slice = grp.pooled ? kq_mask->nb[1]*n_tokens : kq_mask->nb[3];
        m = ggml_view_4d(ctx0, kq_mask, kq_mask->ne[0], n_rows, 1, nh, kq_mask->nb[1], nb_slice, nb_slice,
                         (n_tokens - n_rows)*kq_mask->nb[1]);
    } else {
        qs = ggml_permute(ctx0, qs, 0, 2, 1, 3);                               // [d, n_rows, n_head]
        m = ggml_view_2d(ctx0, kq_mask, kq_mask->ne[0], n_rows, kq_mask->nb[1], (n_tokens - n_rows)*kq_mask->nb[1]);
    }
    if (!ggml_is_contiguous(m)) {
        m = ggml_cont(ctx0, m); // a per-head mask: the last rows of every head's slice
    }
    ggml_tensor * kq = ggml_mul_mat(ctx0, ks, qs);                              // [n_kv, n_rows, rk, n_head_kv]
    ggml_prec_set_acc(kq, GGML_PREC_F32);
    ggml_tensor * p = ggml_soft_max_ext(ctx0, kq, m, kq_scale, 0.0f);
    // [n_kv, n_rows, n_head]: query head g*rk + r is KV head g's r-th, as in the model
    p = ggml_reshape_3d(ctx0, p, p->ne[0], n_rows, n_head);
    if (kvzip) {
        // KVzip takes the largest probability any query row of any query head of a group gives a key (the paper
        // and kvpress): the maximum over the rows first, on the backend (one pooling window spanning them), then
        // over the heads of the small result, so the host reads one row per KV head instead of n_rows
        const int64_t n_kv = p->ne[0];
        ggml_tensor * pr = ggml_pool_2d(ctx0, p, GGML_OP_POOL_MAX, 1, (int) n_rows, 1, (int) n_rows, 0, 0); // [n_kv, 1, n_head]
        pr = ggml_cont(ctx0, ggml_permute(ctx0, ggml_reshape_2d(ctx0, pr, n_kv, n_head), 1, 0, 2, 3));  // [n_head, n_kv]
        if (grp.head_scores()) {
            const int rk = (int) rk_sum;
            ggml_tensor * ph = ggml_pool_1d(ctx0, pr, GGML_OP_POOL_MAX, rk, rk, 0);  // [n_head_kv, n_kv] (pooled: [1, n_kv])
            ph = ggml_reshape_3d(ctx0, ph, grp.n_head_kv, ggml_nelements(ph) / grp.n_head_kv, 1);
            ggml_set_output(ph);
            ggml_build_forward_expand(gf, ph);
            grp.t_rows_heads = outs.rows_heads = ph;
        }
        if (grp.layer_scores()) {
            ggml_tensor * pl = ggml_pool_1d(ctx0, pr, GGML_OP_POOL_MAX, (int) n_head, (int) n_head, 0);
            pl = ggml_reshape_3d(ctx0, pl, 1, n_kv, 1);
            ggml_set_output(pl);
            ggml_build_forward_expand(gf, pl);
            grp.t_rows = outs.rows = pl;
        }
        return;
    }
    p = ggml_cont(ctx0, ggml_permute(ctx0, p, 1, 2, 0, 3));                     // [n_head, n_kv, n_rows]
    const int64_t n_kv = p->ne[1];
    if (grp.head_scores()) {
        // query head q reads KV head q / (n_head / n_head_kv): average each KV head's query heads
        const int64_t rk = n_head / grp.n_head_kv;
        ggml_tensor * ph = ggml_reshape_2d(ctx0, p, rk_sum, n_head * n_kv * n_rows / rk_sum);
        ph = ggml_sum_rows(ctx0, ph);                                           // [1, n_head_kv*n_cells*n_rows]
        ph = ggml_reshape_3d(ctx0, ph, grp.n_head_kv, ggml_nelements(ph) / (grp.n_head_kv * n_rows), n_rows); // [n_head_kv, n_cells, n_rows]
        ph = ggml_scale(ctx0, ph, 1.0f/rk);
        ggml_set_output(ph);
        ggml_build_forward_expand(gf, ph);
        grp.t_rows_heads = outs.rows_heads = record ? ph : nullptr;
    }
    if (grp.layer_scores()) {
        ggml_tensor * pl = ggml_sum_rows(ctx0, p);                              // [1, n_kv, n_rows]
        pl = ggml_scale(ctx0, pl, 1.0f/n_head);                                 // mean over query heads
        ggml_set_output(pl);
        ggml_build_forward_expand(gf, pl);
        grp.t_rows = outs.rows = record ? pl : nullptr;
    }
}
