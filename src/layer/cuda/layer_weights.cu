// The GPU layer's weights (include/moekit/layer.h): the rank's slots gathered from all experts of
// the layer and uploaded once, in the GEMM's format (FP8 blocks, or MXFP4 in the encodings of
// mxfp4.h), the router, and the shared expert as slot E_loc where it has the routed shape; or
// another layer's, shared.
#include <algorithm>
#include <cstring>

#include "ep/cuda/ep_format.h"
#include "layer/cuda/layer_impl.cuh"
#include "moekit/check.h"
#include "moekit/layout.h"
#include "moekit/mxfp4.h"
#include "moekit/quant.h"
#include "moekit/weights.h"

namespace moekit::gpu {

namespace {

// The rank's local experts' operand: slot rank * E_loc + i holds logical expert phy2log[slot].
void gather(const ExpertWeights& all, const int32_t* phy2log, int first_slot, int e_loc, std::vector<uint8_t>& w,
            std::vector<float>& scales) {
  const WeightLayout& l = all.layout;
  const size_t w_per = size_t(l.n) * l.k, s_per = size_t(l.n / kQuantBlock) * (l.k / kQuantBlock);
  w.resize(w_per * e_loc);
  scales.resize(s_per * e_loc);
  for (int i = 0; i < e_loc; ++i) {
    const int e = phy2log[first_slot + i];
    std::memcpy(w.data() + i * w_per, all.w.data() + e * w_per, w_per);
    std::memcpy(scales.data() + i * s_per, all.scales.data() + e * s_per, s_per * sizeof(float));
  }
}

}  // namespace

void gather_mxfp4(const Mxfp4ExpertWeights& all, const int32_t* phy2log, int first_slot, int e_loc,
                  std::vector<uint8_t>& codes, std::vector<uint32_t>& words, std::vector<float>& bias) {
  const Mxfp4WeightLayout& l = all.layout;
  const Mxfp4WeightLayout local{e_loc, l.n, l.k};
  const size_t c_per = size_t(l.n) * l.row_bytes(), s_per = size_t(l.n) * l.row_scales();
  std::vector<uint8_t> raw_codes(c_per * e_loc), raw_scales(s_per * e_loc);
  bias.clear();
  for (int i = 0; i < e_loc; ++i) {
    const int e = phy2log[first_slot + i];
    std::memcpy(raw_codes.data() + i * c_per, all.w.data() + e * c_per, c_per);
    std::memcpy(raw_scales.data() + i * s_per, all.scales.data() + e * s_per, s_per);
    if (!all.bias.empty()) bias.insert(bias.end(), all.bias.begin() + ptrdiff_t(e) * l.n, all.bias.begin() + ptrdiff_t(e + 1) * l.n);
  }
  codes.resize(raw_codes.size());
  mxfp4_codes_for_gemm(local, raw_codes.data(), codes.data());
  words.resize(raw_scales.size() / 4);
  mxfp4_scales_for_gemm(local, raw_codes.data(), raw_scales.data(), words.data());
}

void GpuMoeLayer::Impl::share_weights(const Impl& other, const int32_t* phy2log) {
  MOEKIT_CHECK(other.rank == rank && other.e_loc == e_loc && other.d == d && other.inter == inter &&
                   other.num_experts == num_experts &&
                   std::equal(other.local_experts.begin(), other.local_experts.end(), phy2log + rank * e_loc),
               fmtr("share_weights_with: a layer of rank {} holding other experts or shapes, expected rank {} of "
                    "the same model and placement", other.rank, rank));
  owner = const_cast<Impl*>(&other);
  ++owner->num_sharers;
  w1 = other.w1, w1s = other.w1s, w2 = other.w2, w2s = other.w2s;
  w1_mx = other.w1_mx, w2_mx = other.w2_mx, b1 = other.b1, b2 = other.b2;
  router_w = other.router_w, router_bias = other.router_bias, router_logit_bias = other.router_logit_bias;
}

void GpuMoeLayer::Impl::upload_weights(const MoeLayerWeights& weights, const int32_t* phy2log) {
  if (mxfp4) {
    std::vector<uint8_t> codes;
    std::vector<uint32_t> words;
    std::vector<float> bias;
    gather_mxfp4(weights.w1_mxfp4, phy2log, rank * e_loc, e_loc, codes, words, bias);
    w1 = upload(codes);
    w1_mx = upload(words);
    if (!bias.empty()) b1 = upload(bias);
    gather_mxfp4(weights.w2_mxfp4, phy2log, rank * e_loc, e_loc, codes, words, bias);
    w2 = upload(codes);
    w2_mx = upload(words);
    if (!bias.empty()) b2 = upload(bias);
    // The router reads the padded x: its weight gets zero columns there (exact: adds zeros).
    std::vector<float> router(size_t(num_experts) * d, 0.0f);
    for (int e = 0; e < num_experts; ++e)
      std::copy_n(weights.router_weight.begin() + ptrdiff_t(size_t(e) * model_d), model_d,
                  router.begin() + ptrdiff_t(size_t(e) * d));
    router_w = upload(router);
    if (!weights.router_bias.empty()) router_bias = upload(weights.router_bias);
    if (!weights.router_logit_bias.empty()) router_logit_bias = upload(weights.router_logit_bias);
    return;
  }
  std::vector<uint8_t> w;
  std::vector<float> sc;
  // W1 and W2 of the local slots, and the shared expert appended as slot E_loc where it fits.
  auto append = [&](const ExpertWeights& shared) {
    if (!shared_slot) return;
    w.insert(w.end(), shared.w.begin(), shared.w.end());
    sc.insert(sc.end(), shared.scales.begin(), shared.scales.end());
  };
  gather(weights.w1, phy2log, rank * e_loc, e_loc, w, sc);
  append(weights.shared_w1);
  w1 = upload(w);
  w1s = upload(sc);
  gather(weights.w2, phy2log, rank * e_loc, e_loc, w, sc);
  append(weights.shared_w2);
  w2 = upload(w);
  w2s = upload(sc);
  router_w = upload(weights.router_weight);
  if (!weights.router_bias.empty()) router_bias = upload(weights.router_bias);
}

}  // namespace moekit::gpu
