// PolyKV: the score state of every group, the selection rules (as polykv_cpp/patterns.py), eviction, and the moves
// that keep each group's kept tokens in its first cells (per-head repack, exact-mode compaction)

#include "llama-polykv.h"

#include "llama-impl.h"
#include "llama-io.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <stdexcept>
#include <type_traits>

int32_t llama_kv_cache_poly::group::ring_size() const {
    int32_t w = collect_all ? LLAMA_POLYKV_PORTABLE_OBS_WINDOW : 0;
    for (int p = 0; p < 2; ++p) {
        if (phase[p].pattern == LLAMA_POLYKV_SNAPKV || phase[p].pattern == LLAMA_POLYKV_PYRAMIDKV) {
            w = std::max(w, phase[p].obs_window);
        }
    }
    if (stream == LLAMA_POLYKV_SNAPKV || stream == LLAMA_POLYKV_PYRAMIDKV) {
        w = std::max(w, phase[0].obs_window);
    }
    return w;
}

void llama_kv_cache_poly::on_placed(uint32_t g, const std::vector<uint32_t> & cells, const llama_ubatch & ubatch) {
    auto & grp = groups[g];
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        pos_next = std::max(pos_next, ubatch.pos[i] + 1);
    }
    grp.new_cells = cells;
    for (uint32_t k = 0; k < grp.n_slots(); ++k) {
        const size_t off = (size_t) k * grp.capacity;
        for (uint32_t c : cells) {
            grp.acc[off + c]   = 0.0f;
            grp.last[off + c]  = 0.0f;
            grp.knorm[off + c] = 0.0f;
            // KVzip: a token that arrives after the reconstruction pass (a question fed after a compressed
            // context) was not scored by it: keep it before any scored token
            grp.zmax[off + c]  = kvzip_active ? 0.0f : INFINITY;
            grp.ea[off + c]    = 0.0f;
            for (auto & row : grp.ring) {
                row[off + c] = 0.0f;
            }
            if (grp.win_ok) {
                grp.win_sum[off + c] = 0.0;
            }
        }
    }
    grp.ea_new = 0;
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        grp.ea_new += ubatch.pos[i] >= ea_n_sink(grp);
    }
    if (grp.per_head) {
        for (uint32_t h = 0; h < grp.n_head_kv; ++h) {
            for (size_t i = 0; i < cells.size(); ++i) {
                grp.hpos[(size_t) h*grp.capacity + cells[i]] = ubatch.pos[i];
                if (grp.pooled) {
                    grp.howner[(size_t) h*grp.capacity + cells[i]] = (uint8_t) h;
                }
            }
        }
    }
}

void llama_kv_cache_poly::fetch_scores(ggml_backend_sched_t sched) {
    // a decode step's outputs are small; a prompt ubatch's rows can be megabytes per layer (H2O reads every row):
    // beyond this much in all, the rest is read layer by layer as before
    const size_t max_bytes = 16u << 20;
    size_t total = 0;
    std::vector<ggml_backend_t> waits;
    for (auto & grp : groups) {
        grp.fetched.clear();
        for (ggml_tensor * t : { grp.t_rows, grp.t_rows_heads, grp.t_knorm, grp.t_ea_sum, grp.t_ea_sq }) {
            if (!t || t->type != GGML_TYPE_F32 || total + ggml_nbytes(t) > max_bytes) {
                continue;
            }
            total += ggml_nbytes(t);
            grp.fetched.emplace_back(t, std::vector<float>(ggml_nelements(t)));
            float * dst = grp.fetched.back().second.data();
            ggml_backend_t backend = ggml_backend_sched_get_tensor_backend(sched, t);
            if (!backend) {
                ggml_backend_tensor_get(t, dst, 0, ggml_nbytes(t));
                continue;
            }
            ggml_backend_tensor_get_async(backend, t, dst, 0, ggml_nbytes(t));
            if (std::find(waits.begin(), waits.end(), backend) == waits.end()) {
                waits.push_back(backend);
            }
        }
    }
    for (ggml_backend_t backend : waits) {
        ggml_backend_synchronize(backend);
    }
}

// n floats of a score output: the copy fetch_scores made after this ubatch, else read now
static void read_floats(const llama_kv_cache_poly::group & grp, const ggml_tensor * t, float * dst, size_t n) {
    for (const auto & f : grp.fetched) {
        if (f.first == t && f.second.size() >= n) {
            memcpy(dst, f.second.data(), n * sizeof(float));
            return;
        }
    }
    ggml_backend_tensor_get(t, dst, 0, n * sizeof(float));
}

// add the attention rows of one graph output to the score state: t is [nh, n_kv, n_rows] (rows[(r*n_kv + j)*nh + h]:
// attention of query row r to cell j, averaged over the query heads of the layer (nh = 1) or of KV head h), and
// head h's state lives at off(h)
template <typename F>
static void add_rows(llama_kv_cache_poly::group & grp, ggml_tensor * t, int32_t w, F off) {
    const int64_t nh = t->ne[0];
    const int64_t n_kv = t->ne[1];
    const int64_t n_rows = t->ne[2];
    std::vector<float> rows(nh * n_kv * n_rows);
    read_floats(grp, t, rows.data(), rows.size());
    auto at = [&](int64_t r, int64_t j, int64_t h) { return rows[(r*n_kv + j)*nh + h]; };

    if (grp.needs(LLAMA_POLYKV_H2O)) {
        for (int64_t h = 0; h < nh; ++h) {
            float * acc = grp.acc.data() + off(h);
            for (int64_t r = 0; r < n_rows; ++r) {
                for (int64_t j = 0; j < n_kv; ++j) {
                    acc[j] += at(r, j, h);
                }
            }
        }
    }
    if (grp.needs(LLAMA_POLYKV_TOVA)) {
        for (int64_t h = 0; h < nh; ++h) {
            float * last = grp.last.data() + off(h);
            std::fill(last, last + grp.capacity, 0.0f);
            for (int64_t j = 0; j < n_kv; ++j) {
                last[j] = at(n_rows - 1, j, h);
            }
        }
    }
    if (w > 0) {
        // the ring's rows are shared by the slots: the newest rows go to the end, the layer's and the heads' alike
        const int64_t r0 = std::max<int64_t>(0, n_rows - w);
        const size_t n_ring = grp.ring.size();
        for (int64_t r = r0; r < n_rows; ++r) {
            float * row = grp.ring[n_ring - (n_rows - r)].data();
            for (int64_t h = 0; h < nh; ++h) {
                for (int64_t j = 0; j < n_kv; ++j) {
                    row[off(h) + j] = at(r, j, h);
                }
            }
        }
    }
}

// the ring's new rows into win_sum, the rows that left it out; every ring_size() rows (and after any other change
// to the ring) the rows are summed again, oldest first, so rounding does not build up over a long generation
static void update_window(llama_kv_cache_poly::group & grp, size_t n_new, const std::vector<std::vector<float>> & gone) {
    const size_t n = grp.ring.empty() ? 0 : grp.ring.front().size();
    if (grp.win_ok && grp.win_sum.size() == n && grp.win_age + 1 < grp.ring_size()) {
        double * sum = grp.win_sum.data();
        for (size_t r = grp.ring.size() - n_new; r < grp.ring.size(); ++r) {
            const float * row = grp.ring[r].data();
            for (size_t i = 0; i < n; ++i) {
                sum[i] += row[i];
            }
        }
        for (const auto & out : gone) {
            const float * row = out.data();
            for (size_t i = 0; i < n; ++i) {
                sum[i] -= row[i];
            }
        }
        grp.win_age += 1;
        return;
    }
    grp.win_sum.assign(n, 0.0);
    for (const auto & in : grp.ring) {
        for (size_t i = 0; i < n; ++i) {
            grp.win_sum[i] += in[i];
        }
    }
    grp.win_age = 0;
    grp.win_ok  = true;
}

void llama_kv_cache_poly::read_kvzip(group & grp) {
    auto fold = [&](ggml_tensor * t, auto off) {
        const int64_t nh = t->ne[0];
        const int64_t n_kv = t->ne[1];
        const int64_t n_rows = t->ne[2];
        std::vector<float> rows(nh * n_kv * n_rows);
        read_floats(grp, t, rows.data(), rows.size());
        for (int64_t h = 0; h < nh; ++h) {
            float * z = grp.zmax.data() + off(h);
            for (int64_t r = 0; r < n_rows; ++r) {
                for (int64_t j = 0; j < n_kv; ++j) {
                    z[j] = std::max(z[j], rows[(r*n_kv + j)*nh + h]);
                }
            }
        }
    };
    if (grp.t_rows) {
        fold(grp.t_rows, [](int64_t) { return (size_t) 0; });
    }
    if (grp.t_rows_heads) {
        fold(grp.t_rows_heads, [&](int64_t h) { return grp.head_off((uint32_t) h); });
    }
    grp.t_rows  = nullptr;
    grp.t_rows_heads = nullptr;
    grp.t_knorm = nullptr;
}

void llama_kv_cache_poly::read_scores(group & grp, uint32_t n_tokens, bool with_query_stats) {
    const size_t cap = grp.capacity;
    if (grp.t_rows || grp.t_rows_heads) {
        const int32_t w = grp.ring_size();
        size_t n_new = 0;
        std::vector<std::vector<float>> gone;
        if (w > 0) {
            // push one zeroed row per new query row (as many as the graph kept), drop the oldest beyond w
            const int64_t n_rows = (grp.t_rows ? grp.t_rows : grp.t_rows_heads)->ne[2];
            for (int64_t r = std::max<int64_t>(0, n_rows - w); r < n_rows; ++r) {
                grp.ring.emplace_back((size_t) grp.n_slots() * cap, 0.0f);
                n_new += 1;
            }
            while ((int32_t) grp.ring.size() > w) {
                gone.push_back(std::move(grp.ring.front()));
                grp.ring.erase(grp.ring.begin());
            }
        }
        if (grp.t_rows) {
            add_rows(grp, grp.t_rows, w, [](int64_t) { return (size_t) 0; });
        }
        if (grp.t_rows_heads) {
            add_rows(grp, grp.t_rows_heads, w, [&](int64_t h) { return grp.head_off((uint32_t) h); });
        }
        if (w > 0) {
            update_window(grp, n_new, gone);
        }
    }
    if (grp.t_knorm) {
        const int64_t n_head_kv = grp.t_knorm->ne[1];
        GGML_ASSERT(grp.t_knorm->ne[2] == (int64_t) n_tokens && grp.new_cells.size() == n_tokens);
        std::vector<float> norms(n_head_kv * n_tokens);
        read_floats(grp, grp.t_knorm, norms.data(), norms.size());
        for (uint32_t t = 0; t < n_tokens; ++t) {
            const uint32_t c = grp.new_cells[t];
            if (grp.head_scores()) {
                for (int64_t h = 0; h < n_head_kv; ++h) {
                    grp.knorm[grp.head_off((uint32_t) h) + c] = (float) std::sqrt((double) norms[t*n_head_kv + h]);
                }
            }
            if (grp.layer_scores()) {
                double s = 0.0;
                for (int64_t h = 0; h < n_head_kv; ++h) {
                    s += std::sqrt((double) norms[t*n_head_kv + h]);
                }
                grp.knorm[c] = (float) (s / n_head_kv);
            }
        }
    }
    if (grp.t_ea_sum && grp.t_ea_sq && !grp.ea_sum.empty() && with_query_stats) {
        GGML_ASSERT((size_t) ggml_nelements(grp.t_ea_sum) == grp.ea_sum.size() &&
                    (size_t) ggml_nelements(grp.t_ea_sq) == grp.ea_sq.size());
        std::vector<float> buf(grp.ea_sq.size());
        read_floats(grp, grp.t_ea_sum, buf.data(), grp.ea_sum.size());
        for (size_t i = 0; i < grp.ea_sum.size(); ++i) {
            grp.ea_sum[i] += buf[i];
        }
        read_floats(grp, grp.t_ea_sq, buf.data(), grp.ea_sq.size());
        for (size_t i = 0; i < grp.ea_sq.size(); ++i) {
            grp.ea_sq[i] += buf[i];
        }
        grp.ea_n += grp.ea_new;
    }
    grp.t_rows  = nullptr;
    grp.t_rows_heads = nullptr;
    grp.t_knorm = nullptr;
    grp.t_ea_sum = nullptr;
    grp.t_ea_sq  = nullptr;
}

// as polykv_cpp.patterns._protect: +inf on the last min(window, budget) and the first min(n_sink, budget - w)
static void protect(std::vector<double> & sc, int32_t budget, int32_t n_sink, int32_t window) {
    const int32_t n = sc.size();
    const int32_t w = std::max(0, std::min({ window, budget, n }));
    const int32_t s = std::max(0, std::min({ n_sink, budget - w, n - w }));
    for (int32_t i = n - w; i < n; ++i) {
        sc[i] = INFINITY;
    }
    for (int32_t i = 0; i < s; ++i) {
        sc[i] = INFINITY;
    }
}

// as polykv_cpp.patterns.pool1d(x, kernel, "max", shift): the largest score within kernel / 2 places on either side
// of i - shift, so a token after a high-scored one (the digits after a needle's key) ranks with it. NaN scores count as
// -inf. Linear in n whatever the kernel (van Herk / Gil-Werman): x padded with -inf by kernel / 2 + |shift| on both
// sides is cut into blocks of k = 2 (kernel / 2) + 1; a window of k then spans the end of one block and the start of
// the next
static std::vector<double> max_pool(const std::vector<double> & x, int32_t kernel, int32_t shift) {
    const int32_t n = x.size();
    const int32_t h = kernel / 2;
    const int32_t k = 2*h + 1;
    const int32_t margin = h + std::abs(shift);
    const int32_t m = n + 2*margin;
    std::vector<double> pad(m, -INFINITY);
    for (int32_t i = 0; i < n; ++i) {
        pad[margin + i] = std::isnan(x[i]) ? -INFINITY : x[i];
    }
    std::vector<double> from_start(m); // the largest from its block's start to j
    std::vector<double> to_end(m);     // the largest from j to its block's end
    for (int32_t b = 0; b < m; b += k) {
        const int32_t e = std::min(b + k, m);
        from_start[b] = pad[b];
        for (int32_t j = b + 1; j < e; ++j) {
            from_start[j] = std::max(from_start[j - 1], pad[j]);
        }
        to_end[e - 1] = pad[e - 1];
        for (int32_t j = e - 2; j >= b; --j) {
            to_end[j] = std::max(to_end[j + 1], pad[j]);
        }
    }
    std::vector<double> out(n);
    for (int32_t i = 0; i < n; ++i) {
        const int32_t a = i + margin - h - shift; // the window [a, a + 2h] of pad
        out[i] = std::max(to_end[a], from_start[a + 2*h]);
    }
    return out;
}

// the score each token of one set ranks by under pattern pp, before sinks and windows are protected; items are
// (pos, cell) sorted by position, off the state offset of the set (0 for a layer), or for a per-head set (pos,
// slot) with off head_off(0)
static std::vector<double> pattern_scores(const llama_kv_cache_poly::group & grp, const llama_polykv_phase_plan & pp,
                                          const std::vector<std::pair<llama_pos, uint32_t>> & items, size_t off) {
    const int32_t n = items.size();
    std::vector<double> sc(n, 0.0);
    switch (pp.pattern) {
        case LLAMA_POLYKV_STREAMINGLLM:
            for (int32_t i = 0; i < n; ++i) {
                sc[i] = (double) i;
            }
            break;
        case LLAMA_POLYKV_H2O:
            for (int32_t i = 0; i < n; ++i) {
                sc[i] = grp.acc[off + items[i].second];
            }
            break;
        case LLAMA_POLYKV_TOVA:
            for (int32_t i = 0; i < n; ++i) {
                sc[i] = grp.last[off + items[i].second];
            }
            break;
        case LLAMA_POLYKV_SNAPKV:
        case LLAMA_POLYKV_PYRAMIDKV:
            {
                // the window's sum per token, its rows added oldest first
                const size_t w = std::min<size_t>(grp.ring.size(), pp.obs_window);
                size_t span = 0;
                for (const auto & it : items) {
                    span = std::max<size_t>(span, it.second + 1);
                }
                std::vector<double> raw(n, 0.0);
                if (grp.win_ok && w == grp.ring.size() && grp.win_sum.size() >= off + span) {
                    for (int32_t i = 0; i < n; ++i) {
                        raw[i] = grp.win_sum[off + items[i].second];
                    }
                } else {
                    for (size_t r = grp.ring.size() - w; r < grp.ring.size(); ++r) {
                        const float * row = grp.ring[r].data() + off;
                        for (int32_t i = 0; i < n; ++i) {
                            raw[i] += row[items[i].second];
                        }
                    }
                }
                sc = max_pool(raw, pp.pool_kernel, pp.pool_shift);
            } break;
        case LLAMA_POLYKV_KVZIP:
            for (int32_t i = 0; i < n; ++i) {
                sc[i] = grp.zmax[off + items[i].second];
            }
            break;
        case LLAMA_POLYKV_EXPECTED_ATTENTION:
            for (int32_t i = 0; i < n; ++i) {
                sc[i] = grp.ea[off + items[i].second];
            }
            break;
        case LLAMA_POLYKV_KNORM:
            for (int32_t i = 0; i < n; ++i) {
                sc[i] = -grp.knorm[off + items[i].second];
            }
            break;
        case LLAMA_POLYKV_FULLKV:
            break;
    }
    if (pp.pool_kernel > 1 && (pp.pattern == LLAMA_POLYKV_KVZIP || pp.pattern == LLAMA_POLYKV_EXPECTED_ATTENTION)) {
        sc = max_pool(sc, pp.pool_kernel, pp.pool_shift);
    }
    return sc;
}

// the scores one token set ranks by (as pattern_scores), with the pattern's sinks and windows protected (+inf) for
// a budget of pp.budget
static std::vector<double> ranked_scores(const llama_kv_cache_poly::group & grp, const llama_polykv_phase_plan & pp,
                                         const std::vector<std::pair<llama_pos, uint32_t>> & items, size_t off) {
    const int32_t b = pp.budget;
    std::vector<double> sc = pattern_scores(grp, pp, items, off);
    if (pp.pattern == LLAMA_POLYKV_STREAMINGLLM) {
        const int32_t s = std::min({ pp.n_sink, b - 1, (int32_t) sc.size() });
        for (int32_t i = 0; i < s; ++i) {
            sc[i] = INFINITY;
        }
    } else if (pp.pattern == LLAMA_POLYKV_SNAPKV || pp.pattern == LLAMA_POLYKV_PYRAMIDKV) {
        protect(sc, b, pp.n_sink, std::max(pp.window, pp.obs_window));
    } else {
        protect(sc, b, pp.n_sink, pp.window);
    }
    return sc;
}

// a score as the selections order it: NaN as -inf, so that every comparison is a strict weak order
static double rank_key(double v) {
    return std::isnan(v) ? -INFINITY : v;
}

// the indices of the k lowest scores in ascending order, among ties the earlier index first (keeping the tail keeps
// the more recent token of a tie); the rest is not sorted: a decode step drops one token of hundreds. A NaN score
// ranks lowest
static std::vector<int32_t> lowest(const std::vector<double> & sc, int32_t k) {
    std::vector<int32_t> order(sc.size());
    std::iota(order.begin(), order.end(), 0);
    auto key  = [&](int32_t i) { return rank_key(sc[i]); };
    auto less = [&](int32_t a, int32_t c) { return key(a) < key(c) || (key(a) == key(c) && a < c); };
    if (k < (int32_t) order.size()) {
        std::nth_element(order.begin(), order.begin() + k, order.end(), less);
        order.resize(k);
    }
    std::sort(order.begin(), order.end(), less);
    return order;
}

// the cells to drop from one token set (as pattern_scores); keeps the pattern's budget, as the reference
static std::vector<uint32_t> select_drop(const llama_kv_cache_poly::group & grp, const llama_polykv_phase_plan & pp,
                                         const std::vector<std::pair<llama_pos, uint32_t>> & items, size_t off) {
    const int32_t n = items.size();
    const int32_t b = pp.budget;
    std::vector<uint32_t> drop;
    if (n <= b || pp.pattern == LLAMA_POLYKV_FULLKV) {
        return drop;
    }
    for (int32_t i : lowest(ranked_scores(grp, pp, items, off), n - b)) {
        drop.push_back(items[i].second);
    }
    return drop;
}

// adaptive selection (Ada-KV: Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation
// for Efficient LLM Inference"), as polykv_cpp.patterns.select_adaptive: the layer keeps n_head_kv x budget (head,
// token) pairs; each head first keeps its own best llama_polykv_adaptive_floor(budget), then the highest-scored of
// the other pairs of every head fill the rest, a head holding at most llama_polykv_adaptive_cap (the cache's rows).
// Scores of different heads compare directly: each is an attention probability (or a key norm) of that head.
// items[h]: head h's (pos, cell) sorted by position; returns the cells each head drops
static std::vector<std::vector<uint32_t>> select_drop_adaptive(const llama_kv_cache_poly::group & grp, const llama_polykv_phase_plan & pp,
                                                               const std::vector<std::vector<std::pair<llama_pos, uint32_t>>> & items) {
    const int32_t nh    = (int32_t) items.size();
    const int32_t b     = pp.budget;
    const int32_t floor = llama_polykv_adaptive_floor(b);
    const int32_t cap   = llama_polykv_adaptive_cap(b, nh);
    int64_t left  = (int64_t) nh * b;
    int64_t n_all = 0;
    int32_t n_max = 0;
    for (const auto & it : items) {
        n_all += (int64_t) it.size();
        n_max = std::max(n_max, (int32_t) it.size());
    }
    std::vector<std::vector<uint32_t>> drop(nh);
    if (n_all <= left && n_max <= cap) { // evict() never calls it for a FullKV phase
        return drop;
    }
    std::vector<std::vector<double>> sc(nh);
    std::vector<std::vector<char>> keep(nh);
    std::vector<int32_t> count(nh, 0);
    for (int32_t h = 0; h < nh; ++h) {
        const int32_t n = items[h].size();
        sc[h] = ranked_scores(grp, pp, items[h], grp.head_off(0));
        keep[h].assign(n, 0);
        const std::vector<int32_t> order = lowest(sc[h], n);
        count[h] = std::min(floor, n);
        for (int32_t k = n - count[h]; k < n; ++k) {
            keep[h][order[k]] = 1;
        }
        left -= count[h];
    }
    // every pair listed head by head, oldest first: a stable ascending sort taken from the top prefers, among ties,
    // the later head and the more recent token
    std::vector<std::pair<int32_t, int32_t>> pairs;
    pairs.reserve(n_all);
    for (int32_t h = 0; h < nh; ++h) {
        for (int32_t i = 0; i < (int32_t) items[h].size(); ++i) {
            pairs.emplace_back(h, i);
        }
    }
    std::stable_sort(pairs.begin(), pairs.end(), [&](const auto & x, const auto & y) {
        return rank_key(sc[x.first][x.second]) < rank_key(sc[y.first][y.second]);
    });
    for (auto it = pairs.rbegin(); it != pairs.rend() && left > 0; ++it) {
        const int32_t h = it->first;
        if (keep[h][it->second] || count[h] >= cap) {
            continue;
        }
        keep[h][it->second] = 1;
        ++count[h];
        --left;
    }
    for (int32_t h = 0; h < nh; ++h) {
        for (int32_t i = 0; i < (int32_t) items[h].size(); ++i) {
            if (!keep[h][i]) {
                drop[h].push_back(items[h][i].second);
            }
        }
    }
    return drop;
}

void llama_kv_cache_poly::restore_plan_budgets() {
    for (auto & grp : groups) {
        grp.phase[0].budget = grp.plan_budget[0];
        grp.phase[1].budget = grp.plan_budget[1];
    }
}

// the layers of each scored prefill pattern re-split their own budgets (scores of different patterns are not on one
// scale): allocate_pool per pattern
void llama_kv_cache_poly::allocate_prompt() {
    restore_plan_budgets();
    std::map<int32_t, std::vector<uint32_t>> pools;
    for (uint32_t g = 0; g < groups.size(); ++g) {
        const auto & pp = groups[g].phase[LLAMA_POLYKV_PHASE_PREFILL];
        const bool scored = pp.needs_scores() || pp.pattern == LLAMA_POLYKV_KNORM;
        if (scored && pp.budget >= 0 && !groups[g].is_swa && groups[g].layers.size() == 1) {
            pools[(int32_t) pp.pattern].push_back(g);
        }
    }
    for (const auto & it : pools) {
        allocate_pool(it.second);
    }
}

// "allocation": "prompt_median": a token set's finite scores divided by their median (the mean of the two middle ones
// for an even count; polykv_cpp.patterns.relative_scores); protected tokens (+inf) stay, and a set whose median is
// not positive (key norms) is left as it is
static void to_relative(std::vector<double> & sc) {
    std::vector<double> v;
    v.reserve(sc.size());
    for (double s : sc) {
        if (std::isfinite(s)) {
            v.push_back(s);
        }
    }
    if (v.empty()) {
        return;
    }
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    const double med = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
    if (!(med > 0.0)) {
        return;
    }
    for (double & s : sc) {
        if (std::isfinite(s)) {
            s /= med;
        }
    }
}

// as polykv_cpp.patterns.allocate_prompt: the pool of the candidate layers' budgets, in (head, token) pairs; every
// token set keeps its best min(b_min, n) first, then the best-scored of all other entries fill the rest. Chunked
// prefill: a layer gets at most its streaming budget (budget x the prefill slack), what its cache holds with room
// for one ubatch more; exact prefill holds the whole prompt. "allocation_cap" caps every layer at cap x its budget
void llama_kv_cache_poly::allocate_pool(const std::vector<uint32_t> & cand) {
    struct entry {
        double  score;
        int32_t k; // candidate index
    };
    int64_t pool = 0;
    std::vector<int64_t> taken(cand.size(), 0);
    std::vector<int64_t> unit(cand.size(), 1);
    std::vector<int64_t> cap(cand.size(), std::numeric_limits<int64_t>::max());
    std::vector<entry> rest;
    for (size_t k = 0; k < cand.size(); ++k) {
        group & grp = groups[cand[k]];
        const auto & pp = grp.phase[LLAMA_POLYKV_PHASE_PREFILL];
        if (pp.pattern == LLAMA_POLYKV_EXPECTED_ATTENTION) {
            score_expected_attention(grp);
        }
        pool += (int64_t) pp.budget * grp.n_head_kv;
        unit[k] = grp.per_head ? 1 : grp.n_head_kv;
        if (!prefill_exact) {
            cap[k] = (int64_t) streaming_phase(pp).budget * grp.n_head_kv;
        }
        if (plan.allocation_cap > 0.0f) {
            const int64_t most = (int64_t) std::ceil((double) pp.budget * plan.allocation_cap);
            cap[k] = std::min(cap[k], most * grp.n_head_kv);
        }
        for (uint32_t s = 0; s < (grp.per_head ? grp.n_head_kv : 1); ++s) {
            std::vector<double> sc = ranked_scores(grp, pp, set_items(grp, s), grp.per_head ? grp.head_off(0) : 0);
            if (plan.allocation_relative) {
                to_relative(sc);
            }
            const int32_t n = (int32_t) sc.size();
            const int32_t f = std::min(plan.b_min, n);
            const std::vector<int32_t> order = lowest(sc, n);
            std::vector<char> top(n, 0);
            for (int32_t i = n - f; i < n; ++i) {
                top[order[i]] = 1;
            }
            taken[k] += (int64_t) f * unit[k];
            for (int32_t i = 0; i < n; ++i) {
                if (!top[i]) {
                    rest.push_back({ sc[i], (int32_t) k });
                }
            }
        }
    }
    int64_t left = pool;
    for (int64_t t : taken) {
        left -= t;
    }
    // listed layer by layer, set by set, oldest first: a stable ascending sort taken from the top prefers, among
    // ties, the later layer, head and token
    std::stable_sort(rest.begin(), rest.end(), [](const entry & a, const entry & b) { return rank_key(a.score) < rank_key(b.score); });
    for (auto it = rest.rbegin(); it != rest.rend() && left > 0; ++it) {
        if (unit[it->k] > left || taken[it->k] + unit[it->k] > cap[it->k]) {
            continue;
        }
        taken[it->k] += unit[it->k];
        left -= unit[it->k];
    }
    for (size_t k = 0; k < cand.size(); ++k) {
        group & grp = groups[cand[k]];
        const int32_t b_plan = grp.plan_budget[LLAMA_POLYKV_PHASE_PREFILL];
        const int32_t b_new  = (int32_t) (taken[k] / grp.n_head_kv);
        grp.phase[LLAMA_POLYKV_PHASE_PREFILL].budget = b_new;
        auto & dec = grp.phase[LLAMA_POLYKV_PHASE_DECODE];
        const int32_t d_plan = grp.plan_budget[LLAMA_POLYKV_PHASE_DECODE];
        if (dec.pattern != LLAMA_POLYKV_FULLKV && d_plan >= 0) {
            dec.budget = d_plan == b_plan || b_plan < 1 ? b_new : std::max<int32_t>(1, (int32_t) ((int64_t) d_plan * b_new / b_plan));
        }
    }
}

std::vector<std::pair<llama_pos, uint32_t>> llama_kv_cache_poly::set_items(const group & grp, uint32_t h) const {
    std::vector<std::pair<llama_pos, uint32_t>> items;
    if (grp.pooled) {
        for (size_t u = 0; u < grp.hpos.size(); ++u) {
            if (grp.hpos[u] >= 0 && grp.howner[u] == h) {
                items.emplace_back(grp.hpos[u], (uint32_t) u);
            }
        }
    } else if (grp.per_head) {
        for (uint32_t c = 0; c < grp.capacity; ++c) {
            const size_t u = (size_t) h*grp.capacity + c;
            if (grp.hpos[u] >= 0) {
                items.emplace_back(grp.hpos[u], (uint32_t) u);
            }
        }
    } else {
        const auto & cells = grp.kv->get_cells(0);
        for (uint32_t c = 0; c < cells.size(); ++c) {
            if (!cells.is_empty(c)) {
                items.emplace_back(cells.pos_get(c), c);
            }
        }
    }
    // a layer keeps old sinks and recent tokens, so its positions usually span a few times its size: then a
    // counting sort by position (stable in cell order) gives std::sort's (pos, cell) order in linear time
    llama_pos lo = std::numeric_limits<llama_pos>::max();
    llama_pos hi = std::numeric_limits<llama_pos>::min();
    for (const auto & it : items) {
        lo = std::min(lo, it.first);
        hi = std::max(hi, it.first);
    }
    const int64_t range = (int64_t) hi - lo + 1;
    if (items.empty() || range > 8 * (int64_t) items.size()) {
        std::sort(items.begin(), items.end());
        return items;
    }
    std::vector<uint32_t> start(range + 1, 0);
    for (const auto & it : items) {
        start[it.first - lo + 1] += 1;
    }
    for (int64_t k = 1; k <= range; ++k) {
        start[k] += start[k - 1];
    }
    std::vector<std::pair<llama_pos, uint32_t>> sorted(items.size());
    for (const auto & it : items) {
        sorted[start[it.first - lo]++] = it;
    }
    return sorted;
}

void llama_kv_cache_poly::evict(group & grp, const llama_polykv_phase_plan & pp) {
    if (pp.pattern == LLAMA_POLYKV_FULLKV || pp.budget < 0) {
        return; // a FullKV sliding-window group behaves exactly as the stock SWA cache (it recycles masked cells)
    }
    if (pp.pattern == LLAMA_POLYKV_EXPECTED_ATTENTION) {
        score_expected_attention(grp);
    }
    if (grp.per_head) {
        // sliding window: what the next query cannot see any more leaves every head first (as below)
        llama_pos p_out = -1;
        if (grp.is_swa) {
            llama_pos pos_max = -1;
            for (llama_pos p : grp.hpos) {
                pos_max = std::max(pos_max, p);
            }
            p_out = pos_max + 2 - (llama_pos) hparams.n_swa;
        }
        for (llama_pos & p : grp.hpos) {
            if (p >= 0 && p < p_out) {
                p = -1;
            }
        }
        std::vector<std::vector<std::pair<llama_pos, uint32_t>>> items;
        for (uint32_t h = 0; h < grp.n_head_kv; ++h) {
            items.push_back(set_items(grp, h));
        }
        std::vector<std::vector<uint32_t>> drop;
        if (pp.selection == LLAMA_POLYKV_SELECT_ADAPTIVE) {
            drop = select_drop_adaptive(grp, pp, items);
        } else {
            for (uint32_t h = 0; h < grp.n_head_kv; ++h) {
                drop.push_back(select_drop(grp, pp, items[h], grp.head_off(0)));
            }
        }
        uint64_t n_drop = 0;
        for (uint32_t h = 0; h < grp.n_head_kv; ++h) {
            for (uint32_t u : drop[h]) {
                grp.hpos[u] = -1;
                ++n_drop;
            }
        }
        grp.n_evicted += n_drop / grp.n_head_kv;
        repack(grp);
        return;
    }
    if (grp.is_swa) {
        // the budget counts visible tokens: those that left the window are masked for every later query (the
        // next one is at pos_max + 1 and sees p > pos_max + 1 - n_swa), so free their cells first
        const llama_pos pos_max = grp.kv->seq_pos_max(seq);
        const llama_pos p_out   = pos_max + 2 - (llama_pos) hparams.n_swa;
        if (p_out > 0 && grp.kv->seq_pos_min(seq) < p_out) {
            grp.kv->seq_rm(seq, 0, p_out);
        }
    }
    const auto items = set_items(grp, 0);
    std::vector<bool> dropped(grp.kv->get_cells(0).size(), false);
    uint64_t n_drop = 0;
    for (uint32_t c : select_drop(grp, pp, items, 0)) {
        dropped[c] = true;
        ++n_drop;
    }
    // each seq_rm scans every cell: remove runs of dropped positions (no kept one between them) at once, so the
    // cost is (kept + 1) scans, not one per dropped token (exact modes drop almost all of an n_ctx-cell cache)
    for (size_t i = 0; i < items.size(); ) {
        if (!dropped[items[i].second]) {
            ++i;
            continue;
        }
        size_t j = i;
        while (j + 1 < items.size() && dropped[items[j + 1].second]) {
            ++j;
        }
        grp.kv->seq_rm(seq, items[i].first, items[j].first + 1);
        i = j + 1;
    }
    grp.n_evicted += n_drop;
}

// the V storage tensor of a layer (the cache exposes it only through views)
static ggml_tensor * v_storage(const llama_kv_cache & kv, int32_t il) {
    ggml_init_params ip = { 4*ggml_tensor_overhead(), nullptr, /*no_alloc*/ true };
    ggml_context * ctx = ggml_init(ip);
    llama_kv_cache::slot_info sinfo;
    sinfo.s0 = 0;
    sinfo.s1 = 0;
    sinfo.strm = { 0 };
    sinfo.idxs = { {} };
    ggml_tensor * view = kv.get_v(ctx, il, 1, sinfo);
    ggml_tensor * v = view->view_src ? view->view_src : view;
    ggml_free(ctx);
    return v;
}

// the first n values of a cache tensor as floats (f32, f16, bf16 or a quantized type whose rows hold whole blocks)
static std::vector<float> cache_floats(ggml_tensor * t, size_t n) {
    std::vector<float> out(n);
    if (t->type == GGML_TYPE_F32) {
        ggml_backend_tensor_get(t, out.data(), 0, n * sizeof(float));
        return out;
    }
    std::vector<uint8_t> raw(ggml_row_size(t->type, n));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    ggml_get_type_traits(t->type)->to_float(raw.data(), out.data(), (int64_t) n);
    return out;
}

void llama_kv_cache_poly::score_expected_attention(group & grp) {
    std::fill(grp.ea.begin(), grp.ea.end(), 0.0f);
    if (grp.ea_sum.empty() || grp.ea_n < 1.0) {
        return; // no query statistics yet: every token scores 0 (the most recent are kept)
    }
    const int32_t il     = grp.layers.front();
    const int32_t n_head = hparams.n_head(il);
    const int32_t nkv    = (int32_t) grp.n_head_kv;
    const int32_t rk     = n_head / nkv;
    const int32_t d      = hparams.n_embd_head_k(il);
    const int32_t dv     = hparams.n_embd_head_v(il);
    const uint32_t cap   = grp.capacity;
    const int32_t n_sink = ea_n_sink(grp);

    // the mean rotation of the next LLAMA_POLYKV_EA_N_FUTURE positions: per rotated pair (a, b), cos and sin averaged
    const int32_t n_rot = std::min(grp.rope.n_rot, d);
    const int32_t half  = n_rot / 2;
    std::vector<double> R((size_t) d * d, 0.0);
    for (int32_t a = 0; a < d; ++a) {
        R[(size_t) a*d + a] = 1.0;
    }
    for (int32_t i = 0; i < half; ++i) {
        const double theta = grp.rope.freq_scale * std::pow((double) grp.rope.freq_base, -2.0 * i / n_rot);
        double c = 0.0, s = 0.0;
        for (int32_t t = 0; t < LLAMA_POLYKV_EA_N_FUTURE; ++t) {
            c += std::cos(theta * (double) (pos_next + t));
            s += std::sin(theta * (double) (pos_next + t));
        }
        c /= LLAMA_POLYKV_EA_N_FUTURE;
        s /= LLAMA_POLYKV_EA_N_FUTURE;
        const bool neox = grp.rope.mode == LLAMA_ROPE_TYPE_NEOX;
        const int32_t a = neox ? i : 2*i;
        const int32_t b = neox ? i + half : 2*i + 1;
        R[(size_t) a*d + a] = c;
        R[(size_t) a*d + b] = -s;
        R[(size_t) b*d + a] = s;
        R[(size_t) b*d + b] = c;
    }

    // per query head: m = scale * R mu and M = scale^2 / 2 * R Sigma R^T (Sigma: the population covariance), so that
    // a key's expected logit is m.k + k^T M k (kvpress: mu.k / sqrt(d) + k^T Sigma k / (2 d))
    const double sc = grp.ea_kq_scale;
    std::vector<float> m((size_t) n_head * d);
    std::vector<float> M((size_t) n_head * d * d);
    {
        std::vector<double> mu(d), cov((size_t) d * d), tmp((size_t) d * d);
        for (int32_t h = 0; h < n_head; ++h) {
            const double * s1 = &grp.ea_sum[(size_t) h*d];
            const double * s2 = &grp.ea_sq[(size_t) h*d*d];
            for (int32_t a = 0; a < d; ++a) {
                mu[a] = s1[a] / grp.ea_n;
            }
            for (int32_t a = 0; a < d; ++a) {
                for (int32_t b = 0; b < d; ++b) {
                    cov[(size_t) a*d + b] = s2[(size_t) a*d + b] / grp.ea_n - mu[a]*mu[b];
                }
            }
            for (int32_t a = 0; a < d; ++a) {
                double v = 0.0;
                for (int32_t b = 0; b < d; ++b) {
                    v += R[(size_t) a*d + b] * mu[b];
                }
                m[(size_t) h*d + a] = (float) (sc * v);
            }
            // tmp = R cov, M = tmp R^T
            for (int32_t a = 0; a < d; ++a) {
                for (int32_t b = 0; b < d; ++b) {
                    double v = 0.0;
                    for (int32_t k = 0; k < d; ++k) {
                        v += R[(size_t) a*d + k] * cov[(size_t) k*d + b];
                    }
                    tmp[(size_t) a*d + b] = v;
                }
            }
            for (int32_t a = 0; a < d; ++a) {
                for (int32_t b = 0; b < d; ++b) {
                    double v = 0.0;
                    for (int32_t k = 0; k < d; ++k) {
                        v += tmp[(size_t) a*d + k] * R[(size_t) b*d + k];
                    }
                    M[((size_t) h*d + a)*d + b] = (float) (0.5 * sc * sc * v);
                }
            }
        }
    }

    ggml_tensor * kt = grp.kv->get_k_storage(il);
    ggml_tensor * vt = v_storage(*grp.kv, il);
    const size_t n_embd_k = (size_t) nkv * d;
    const size_t n_embd_v = (size_t) nkv * dv;
    const std::vector<float> kf = cache_floats(kt, n_embd_k * cap);
    const std::vector<float> vf = cache_floats(vt, n_embd_v * cap);

    const auto & cells = grp.kv->get_cells(0);
    for (int32_t g = 0; g < nkv; ++g) {
        // the tokens KV head g holds beyond the sinks (its own set per head, else the layer's): as slots
        // u = s*cap + c, the key and value of cell c's head slot s (a pooled group's head g may hold any slot)
        std::vector<uint32_t> set;
        if (grp.per_head) {
            for (size_t u = 0; u < grp.hpos.size(); ++u) {
                if (grp.hpos[u] >= n_sink && grp.owner_of(u) == (uint32_t) g) {
                    set.push_back((uint32_t) u);
                }
            }
        } else {
            for (uint32_t c = 0; c < cap; ++c) {
                if (!cells.is_empty(c) && cells.pos_get(c) >= n_sink) {
                    set.push_back((uint32_t) g*cap + c);
                }
            }
        }
        if (set.empty()) {
            continue;
        }
        std::vector<double> prob(set.size(), 0.0), logit(set.size());
        for (int32_t q = g*rk; q < (g + 1)*rk; ++q) {
            const float * mq = &m[(size_t) q*d];
            const float * Mq = &M[(size_t) q*d*d];
            double lmax = -INFINITY;
            for (size_t j = 0; j < set.size(); ++j) {
                const float * k = &kf[(size_t) (set[j] % cap)*n_embd_k + (size_t) (set[j] / cap)*d];
                float lin = 0.0f, quad = 0.0f;
                for (int32_t a = 0; a < d; ++a) {
                    const float * row = Mq + (size_t) a*d;
                    float v = 0.0f;
                    for (int32_t b = 0; b < d; ++b) {
                        v += row[b] * k[b];
                    }
                    quad += v * k[a];
                    lin  += mq[a] * k[a];
                }
                logit[j] = (double) lin + (double) quad;
                lmax = std::max(lmax, logit[j]);
            }
            double z = 0.0;
            for (size_t j = 0; j < set.size(); ++j) {
                logit[j] = std::exp(logit[j] - lmax);
                z += logit[j];
            }
            for (size_t j = 0; j < set.size(); ++j) {
                prob[j] += logit[j] / z / rk; // the mean over the KV head's query heads
            }
        }
        for (size_t j = 0; j < set.size(); ++j) {
            const uint32_t c = set[j] % cap;
            const uint32_t s = set[j] / cap;
            double vn = 0.0;
            for (int32_t i = 0; i < dv; ++i) {
                const float v = v_trans ? vf[((size_t) s*dv + i)*cap + c] : vf[(size_t) c*n_embd_v + (size_t) s*dv + i];
                vn += (double) v * v;
            }
            const double score = prob[j] * std::sqrt(vn); // kvpress: (scores + epsilon) * ||v||, epsilon 0
            if (grp.head_scores()) {
                grp.ea[grp.head_off(0) + set[j]] = (float) score;
            }
            if (grp.layer_scores()) {
                grp.ea[c] += (float) (score / nkv); // one set per layer: the mean over its KV heads
            }
        }
    }
}

static int device_repack_mode() {
    const char * env = getenv("LLAMA_POLYKV_DEVICE_REPACK");
    if (!env || !*env) {
        return -1; // auto: caches that are not in host memory
    }
    return atoi(env) != 0 ? 1 : 0;
}

bool llama_kv_cache_poly::repack_on_device(const group & grp, const std::vector<repack_move> & moves) {
    const int mode = device_repack_mode(); // read each time: a test switches it within one process
    if (mode == 0 || v_trans) {
        return false; // a transposed V holds a head's values in d separate runs, not one row
    }
    struct copy { ggml_tensor * t; int64_t d; };
    std::vector<copy> copies;
    bool all_host = true;
    for (int32_t il : grp.layers) {
        ggml_tensor * k = grp.kv->get_k_storage(il);
        ggml_tensor * v = v_storage(*grp.kv, il);
        for (ggml_tensor * t : { k, v }) {
            const int64_t d = t == v ? hparams.n_embd_head_v(il) : hparams.n_embd_head_k(il);
            // F32/F16/BF16 go through get_rows' F32 rows and back unchanged; a quantized type would be requantized
            if (!t->buffer || ggml_is_quantized(t->type) || t->ne[0] != d * grp.n_head_kv || t->ne[2] != 1 ||
                !ggml_is_contiguous(t)) {
                return false;
            }
            all_host &= ggml_backend_buffer_is_host(t->buffer);
            copies.push_back({ t, d });
        }
    }
    if (all_host && mode != 1) {
        return false; // host memory: plain copies cost less than a graph
    }

    const int64_t n = (int64_t) moves.size();
    const int64_t n_rows = (int64_t) grp.n_head_kv * grp.capacity; // a cell row holds its heads side by side
    std::vector<int32_t> idx(2 * n); // the source rows, then the destination rows: one upload
    for (int64_t i = 0; i < n; ++i) {
        idx[i]     = (int32_t) (moves[i].src * grp.n_head_kv + moves[i].src_slot);
        idx[n + i] = (int32_t) (moves[i].dst * grp.n_head_kv + moves[i].dst_slot);
    }

    // a backend of its device and an allocator for each buffer type holding these caches (layers offloaded to
    // different devices), made once
    for (const auto & c : copies) {
        ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(c.t->buffer);
        bool known = false;
        for (const auto & r : repackers) {
            known |= r.buft == buft;
        }
        if (known) {
            continue;
        }
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
        if (!dev && ggml_backend_buft_is_host(buft)) {
            dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU); // the plain CPU buffer type names none
        }
        ggml_backend_t backend = dev ? ggml_backend_dev_init(dev, nullptr) : nullptr;
        if (!backend) {
            return false;
        }
        repackers.push_back({ buft, ggml_backend_ptr(backend), ggml_gallocr_ptr(ggml_gallocr_new(buft)) });
    }

    for (auto & rp : repackers) {
        const size_t n_nodes = 2 * copies.size() + 8;
        ggml_init_params ip = { (3 + 3 * copies.size()) * ggml_tensor_overhead() + ggml_graph_overhead_custom(n_nodes, false),
                                nullptr, /*no_alloc*/ true };
        ggml_context_ptr ctx(ggml_init(ip));
        ggml_cgraph * gf = ggml_new_graph_custom(ctx.get(), n_nodes, false);
        ggml_tensor * t_idx = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I32, 2 * n);
        ggml_set_input(t_idx);
        ggml_tensor * t_src = ggml_view_1d(ctx.get(), t_idx, n, 0);
        ggml_tensor * t_dst = ggml_view_1d(ctx.get(), t_idx, n, n * sizeof(int32_t));
        for (const auto & c : copies) {
            if (ggml_backend_buffer_get_type(c.t->buffer) != rp.buft) {
                continue;
            }
            ggml_tensor * rows = ggml_view_2d(ctx.get(), c.t, c.d, n_rows, ggml_row_size(c.t->type, c.d), 0);
            ggml_tensor * moved = ggml_get_rows(ctx.get(), rows, t_src); // every source row is read before any write
            ggml_build_forward_expand(gf, ggml_set_rows(ctx.get(), rows, moved, t_dst));
        }
        if (ggml_graph_n_nodes(gf) == 0) {
            continue; // a buffer type of another group's layers
        }
        bool ok = ggml_gallocr_alloc_graph(rp.galloc.get(), gf);
        if (ok) {
            ggml_backend_tensor_set(t_idx, idx.data(), 0, ggml_nbytes(t_idx));
            ok = ggml_backend_graph_compute(rp.backend.get(), gf) == GGML_STATUS_SUCCESS;
        }
        if (!ok) {
            // the host copies all of it: a move copies a source row that no move overwrites, so redoing the
            // layers another graph already moved gives the same cache
            LLAMA_LOG_WARN("%s: PolyKV: moving the kept rows on %s failed; copying them on the host\n", __func__,
                           ggml_backend_buft_name(rp.buft));
            return false;
        }
    }
    n_device_repacks += 1;
    return true;
}

void llama_kv_cache_poly::repack(group & grp) {
    const uint32_t cap = grp.capacity;
    const uint32_t nh  = grp.n_head_kv;

    // the cells in use after the repack: the largest head's count, or in a pooled group the kept slots over n_head_kv
    uint32_t n_rows = 0;
    std::vector<uint32_t> count(nh, 0);
    uint32_t n_all = 0;
    for (size_t u = 0; u < grp.hpos.size(); ++u) {
        if (grp.hpos[u] >= 0) {
            count[grp.owner_of(u)] += 1;
            n_all += 1;
        }
    }
    for (uint32_t h = 0; h < nh; ++h) {
        n_rows = std::max(n_rows, count[h]);
    }
    if (grp.pooled) {
        n_rows = (n_all + nh - 1) / nh;
    }

    // each head fills its holes below n_rows with its tokens from above n_rows; a pooled group fills any free slot
    // below n_rows with any kept slot above it (the slot's owner goes with it)
    std::vector<repack_move> moves;
    uint32_t hi = 0;
    if (grp.pooled) {
        std::vector<std::pair<uint32_t, uint32_t>> holes; // (slot, cell)
        for (uint32_t c = 0; c < n_rows; ++c) {
            for (uint32_t s = 0; s < nh; ++s) {
                if (grp.hpos[(size_t) s*cap + c] < 0) {
                    holes.emplace_back(s, c);
                }
            }
        }
        size_t k = 0;
        for (uint32_t src = n_rows; src < cap; ++src) {
            for (uint32_t s = 0; s < nh; ++s) {
                if (grp.hpos[(size_t) s*cap + src] < 0) {
                    continue;
                }
                GGML_ASSERT(k < holes.size());
                moves.push_back({ s, src, holes[k].first, holes[k].second });
                hi = std::max(hi, src + 1);
                ++k;
            }
        }
    } else {
        for (uint32_t h = 0; h < nh; ++h) {
            uint32_t dst = 0;
            for (uint32_t src = n_rows; src < cap; ++src) {
                if (grp.hpos[h*cap + src] < 0) {
                    continue;
                }
                while (grp.hpos[h*cap + dst] >= 0) {
                    ++dst;
                }
                GGML_ASSERT(dst < n_rows);
                moves.push_back({ h, src, h, dst });
                hi = std::max(hi, src + 1);
                ++dst;
            }
        }
    }

    if (!moves.empty()) {
        if (!repack_on_device(grp, moves)) {
            for (int32_t il : grp.layers) {
                // K (and V without v_trans): one row per cell, head slot s at s*head_bytes within it
                ggml_tensor * k = grp.kv->get_k_storage(il);
                ggml_tensor * v = v_storage(*grp.kv, il);
                for (ggml_tensor * t : { k, v }) {
                    const bool is_v = t == v;
                    const uint32_t d = is_v ? hparams.n_embd_head_v(il) : hparams.n_embd_head_k(il);
                    const bool trans = is_v && v_trans;
                    const size_t es = ggml_type_size(t->type);
                    if (moves.size() <= 16) {
                        // a few moves (a decode step moves one token per head): copy just those values
                        const size_t row_bytes  = ggml_row_size(t->type, t->ne[0]);
                        const size_t head_bytes = ggml_row_size(t->type, d);
                        std::vector<uint8_t> tmp(trans ? es : head_bytes);
                        for (const auto & m : moves) {
                            if (!trans) {
                                ggml_backend_tensor_get(t, tmp.data(), m.src*row_bytes + m.src_slot*head_bytes, head_bytes);
                                ggml_backend_tensor_set(t, tmp.data(), m.dst*row_bytes + m.dst_slot*head_bytes, head_bytes);
                                continue;
                            }
                            for (uint32_t i = 0; i < d; ++i) {
                                // feature j of cell c at c + cap*j
                                ggml_backend_tensor_get(t, tmp.data(), (((size_t) m.src_slot*d + i)*cap + m.src)*es, es);
                                ggml_backend_tensor_set(t, tmp.data(), (((size_t) m.dst_slot*d + i)*cap + m.dst)*es, es);
                            }
                        }
                        continue;
                    }
                    if (trans) {
                        // V transposed: element (cell c, feature j) at c + cap*j
                        std::vector<uint8_t> all((size_t) nh * d * cap * es);
                        ggml_backend_tensor_get(t, all.data(), 0, all.size());
                        for (const auto & m : moves) {
                            for (uint32_t i = 0; i < d; ++i) {
                                memcpy(&all[(((size_t) m.dst_slot*d + i)*cap + m.dst)*es],
                                       &all[(((size_t) m.src_slot*d + i)*cap + m.src)*es], es);
                            }
                        }
                        ggml_backend_tensor_set(t, all.data(), 0, all.size());
                        continue;
                    }
                    const size_t row_bytes  = ggml_row_size(t->type, t->ne[0]);
                    const size_t head_bytes = ggml_row_size(t->type, d);
                    std::vector<uint8_t> buf((size_t) hi * row_bytes);
                    ggml_backend_tensor_get(t, buf.data(), 0, buf.size());
                    for (const auto & m : moves) {
                        memcpy(&buf[m.dst*row_bytes + m.dst_slot*head_bytes], &buf[m.src*row_bytes + m.src_slot*head_bytes], head_bytes);
                    }
                    ggml_backend_tensor_set(t, buf.data(), 0, (size_t) n_rows * row_bytes);
                }
            }
        }
        for (const auto & m : moves) {
            const size_t s = grp.head_off(m.src_slot) + m.src;
            const size_t t = grp.head_off(m.dst_slot) + m.dst;
            grp.acc[t]   = grp.acc[s];
            grp.last[t]  = grp.last[s];
            grp.knorm[t] = grp.knorm[s];
            grp.zmax[t]  = grp.zmax[s];
            grp.ea[t]    = grp.ea[s];
            for (auto & row : grp.ring) {
                row[t] = row[s];
            }
            if (grp.win_ok) {
                grp.win_sum[t] = grp.win_sum[s];
            }
            const size_t us = (size_t) m.src_slot*cap + m.src;
            const size_t ud = (size_t) m.dst_slot*cap + m.dst;
            grp.hpos[ud] = grp.hpos[us];
            grp.hpos[us] = -1;
            if (grp.pooled) {
                grp.howner[ud] = grp.howner[us];
            }
        }
    }

    // the stock cell of c carries the newest position any head holds there: it is free only when all heads left
    // it, and a sliding-window cache may recycle it only when every head's token there is out of the window
    // (the mask itself comes from hpos, set_input_kq_mask_heads)
    auto & cells = const_cast<llama_kv_cells &>(grp.kv->get_cells(0));
    for (uint32_t c = 0; c < cap; ++c) {
        llama_pos want = -1;
        for (uint32_t h = 0; h < nh; ++h) {
            want = std::max(want, grp.hpos[h*cap + c]);
        }
        const llama_pos have = cells.is_empty(c) ? -1 : cells.pos_get(c);
        if (want == have) {
            continue;
        }
        if (have >= 0) {
            cells.rm(c);
        }
        if (want >= 0) {
            cells.pos_set(c, want);
            cells.seq_add(c, seq);
        }
    }
}

void llama_polykv_io_write::write(const void * src, size_t size) {
    const uint8_t * p = (const uint8_t *) src;
    buf.insert(buf.end(), p, p + size);
}

void llama_polykv_io_write::write_tensor(ggml_tensor * tensor, size_t offset, size_t size) {
    const size_t n0 = buf.size();
    buf.resize(n0 + size);
    ggml_backend_tensor_get(tensor, buf.data() + n0, offset, size);
}

void llama_polykv_io_read::read(void * dst, size_t size) {
    if (pos + size > buf.size()) {
        throw std::runtime_error("PolyKV: a cache move read past its buffer");
    }
    memcpy(dst, buf.data() + pos, size);
    pos += size;
}

void llama_polykv_io_read::read_tensor(ggml_tensor * tensor, size_t offset, size_t size) {
    if (pos + size > buf.size()) {
        throw std::runtime_error("PolyKV: a cache move read past its buffer");
    }
    ggml_backend_tensor_set(tensor, buf.data() + pos, offset, size);
    pos += size;
}

void llama_kv_cache_poly::compact(group & grp) {
    // the cell each position held before the move: its scores follow it
    std::map<llama_pos, uint32_t> old_cell;
    {
        const auto & cells = grp.kv->get_cells(0);
        for (uint32_t i = 0; i < cells.size(); ++i) {
            if (!cells.is_empty(i)) {
                old_cell[cells.pos_get(i)] = i;
            }
        }
    }
    // a whole-cache restore of the stock cache puts the cells it reads at cells 0..n-1
    llama_polykv_io_write w;
    grp.kv->state_write(w);
    llama_polykv_io_read r(w.buf);
    grp.kv->state_read(r);

    std::vector<std::pair<uint32_t, uint32_t>> moves; // (new cell, old cell)
    const auto & cells = grp.kv->get_cells(0);
    for (uint32_t i = 0; i < cells.size(); ++i) {
        if (cells.is_empty(i)) {
            continue;
        }
        const auto it = old_cell.find(cells.pos_get(i));
        GGML_ASSERT(it != old_cell.end());
        moves.emplace_back(i, it->second);
    }
    // every score slot of a cell moves (the layer's and, when a portable prefill scores heads too, each KV head's):
    // slot s of cell i is at s*capacity + i
    const size_t n_slots = grp.n_slots();
    const size_t cap     = grp.capacity;
    std::vector<float> old;
    auto move_scores = [&](std::vector<float> & v) {
        old = v;
        std::fill(v.begin(), v.end(), 0.0f);
        for (size_t sl = 0; sl < n_slots; ++sl) {
            for (const auto & [dst, src] : moves) {
                v[sl * cap + dst] = old[sl * cap + src];
            }
        }
    };
    move_scores(grp.acc);
    move_scores(grp.last);
    move_scores(grp.knorm);
    move_scores(grp.zmax);
    move_scores(grp.ea);
    for (auto & row : grp.ring) {
        move_scores(row);
    }
    grp.ring_changed();
}

void llama_kv_cache_poly::resize(group & grp, uint32_t cap) {
    const uint32_t old_cap = grp.capacity;
    if (cap == old_cap) {
        return;
    }
    auto used_prefix = [&grp](uint32_t & n_used) {
        const auto & cells = grp.kv->get_cells(0);
        bool packed = true;
        n_used = 0;
        for (uint32_t i = 0; i < cells.size(); ++i) {
            if (!cells.is_empty(i)) {
                packed &= i == n_used;
                ++n_used;
            }
        }
        return packed;
    };
    uint32_t n_used = 0;
    if (!used_prefix(n_used)) {
        if (grp.per_head) {
            repack(grp);
        } else {
            compact(grp);
        }
    }
    if (!used_prefix(n_used) || n_used > cap) {
        throw std::runtime_error("PolyKV: a group holding " + std::to_string(n_used) + " cells cannot move into " +
                                 std::to_string(cap) + " cells");
    }
    // the used cells are 0..n_used-1, and a whole-cache restore puts them at the same cells of the new cache, so
    // the per-cell state keeps its indices
    llama_polykv_io_write w;
    grp.kv->state_write(w);
    auto kv_new = new_group_cache(grp, cap); // a failed allocation leaves the group as it was
    llama_polykv_io_read r(w.buf);
    kv_new->state_read(r);
    grp.kv = std::move(kv_new);
    new_layout();
    grp.capacity = cap;

    const uint32_t n_copy = std::min(old_cap, cap);
    auto move_slots = [n_copy, old_cap, cap](auto & v, size_t n_slots, auto fill) {
        std::remove_reference_t<decltype(v)> out(n_slots * cap, fill);
        for (size_t s = 0; s < n_slots; ++s) {
            std::copy_n(v.begin() + s*old_cap, n_copy, out.begin() + s*cap);
        }
        v.swap(out);
    };
    for (auto * v : { &grp.acc, &grp.last, &grp.knorm, &grp.zmax, &grp.ea }) {
        move_slots(*v, grp.n_slots(), 0.0f);
    }
    for (auto & row : grp.ring) {
        move_slots(row, grp.n_slots(), 0.0f);
    }
    grp.ring_changed();
    if (grp.per_head) {
        move_slots(grp.hpos, grp.n_head_kv, (llama_pos) -1);
    }
    if (grp.pooled) {
        move_slots(grp.howner, grp.n_head_kv, (uint8_t) 0);
    }
}

bool llama_kv_cache_poly::kept_scores(int32_t il, int32_t head, std::vector<float> & out) const {
    out.clear();
    if (il < 0 || il >= (int32_t) layer_group.size() || layer_group[il] < 0) {
        return false;
    }
    const auto & grp = groups[layer_group[il]];
    // a per-head layer keeps one set per head: it has no layer-wide scores to give
    if (head < -1 || head >= (int32_t) grp.n_head_kv || (head < 0 ? grp.per_head || !grp.layer_scores() : !grp.head_scores())) {
        return false;
    }
    const auto items = set_items(grp, head < 0 ? 0 : (uint32_t) head);
    // a per-head set's items are slots (after head_off(0)); a layer set's are cells (head `head`'s scores of them)
    const size_t off = head < 0 ? 0 : grp.head_off(grp.per_head ? 0 : (uint32_t) head);
    for (double v : pattern_scores(grp, grp.phase[LLAMA_POLYKV_PHASE_PREFILL], items, off)) {
        out.push_back((float) v);
    }
    return true;
}

std::vector<llama_pos> llama_kv_cache_poly::kept_positions(int32_t il, int32_t head) const {
    std::vector<llama_pos> res;
    if (il < 0 || il >= (int32_t) layer_group.size() || layer_group[il] < 0) {
        return res;
    }
    const auto & grp = groups[layer_group[il]];
    if (grp.per_head) {
        for (size_t u = 0; u < grp.hpos.size(); ++u) {
            if (grp.hpos[u] >= 0 && (head < 0 || grp.owner_of(u) == (uint32_t) head)) {
                res.push_back(grp.hpos[u]);
            }
        }
        std::sort(res.begin(), res.end());
        res.erase(std::unique(res.begin(), res.end()), res.end());
        return res;
    }
    const auto & cells = grp.kv->get_cells(0);
    for (uint32_t i = 0; i < cells.size(); ++i) {
        if (!cells.is_empty(i)) {
            res.push_back(cells.pos_get(i));
        }
    }
    std::sort(res.begin(), res.end());
    return res;
}
