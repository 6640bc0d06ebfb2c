// The taps_ops operator schemas: the one place they are declared. Each backend registers its
// kernels in its own file (csrc/cpu/*.cpp: CPU, csrc/cuda/*.cu: CUDA); Python wrappers with
// defaults and docstrings live in python/taps_ops/__init__.py.
//
// validate (every op): run the checks that read the inputs' data (tree structure, NaN, lengths,
// paths). On CUDA they cost one device sync, so validate=False skips them there (hot loops, CUDA graph
// capture, where validate=True raises); the kernels then still never read or write out of bounds, but
// bad input gives unspecified results. The CPU kernels of build_tree, merge_trees, tree_attention and
// compact_kv check always (no sync to save, and their loops rely on the checks).
#include <Python.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <cmath>
#include <initializer_list>
#include <optional>
#include <vector>

#include "cpu/cpu_isa.h"

namespace {

// The fast entries below call an op through the dispatcher's typed call, for the Python wrapper's common case
// (plain tensors, plain Python numbers, no torch-function mode), without the generic path's schema parsing and
// boxing (1-2 us a call, as long as a small op's own work). The dispatch keys still run (profiler, dispatch
// modes, each backend's checks), except that inputs without gradients outside any mode skip the autograd keys,
// as torch's autograd fallback (boxed, about 1 us) would by redispatching below them. Any other argument
// returns NotImplemented, and the wrapper takes torch.ops, which handles (or rejects) it.

// Whether the arguments are what a fast entry takes: `tensors` exact tensors (None allowed where `optional`).
bool plain_tensors(PyObject* const* args, int tensors, bool optional = false) {
  for (int i = 0; i < tensors; ++i) {
    if (optional && args[i] == Py_None) continue;
    if (!THPVariable_CheckExact(args[i])) return false;
  }
  return true;
}

// call() with the GIL released (as torch.ops does), below the autograd keys when `grad` is false (no input
// needs a gradient, or grad mode is off) and no mode or transform has added keys to the thread's included set
// (BackendSelect, ADInplaceOrView: always).
template <class Call>
at::Tensor call_typed(bool grad, Call&& call) {
  const bool below_autograd =
      !grad && (c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty();
  struct ReleaseGil {
    PyThreadState* state = PyEval_SaveThread();
    ~ReleaseGil() { PyEval_RestoreThread(state); }
  } release;
  std::optional<at::AutoDispatchBelowAutograd> below;
  if (below_autograd) below.emplace();
  return call();
}

bool needs_grad(std::initializer_list<const at::Tensor*> tensors) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : tensors)
    if (t != nullptr && t->defined() && t->requires_grad()) return true;
  return false;
}

// taps_ops._C.tree_attention(q, k, v, tree_mask, kv_lens, scale, validate, tree_nodes, num_queries).
PyObject* tree_attention_py(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 9) {
    PyErr_SetString(PyExc_TypeError, "taps_ops._C.tree_attention takes 9 positional arguments");
    return nullptr;
  }
  if (!plain_tensors(args, 5)) Py_RETURN_NOTIMPLEMENTED;
  PyObject *scale_arg = args[5], *validate_arg = args[6], *nodes_arg = args[7], *queries_arg = args[8];
  if (at::impl::torch_function_mode_enabled() || (scale_arg != Py_None && !PyFloat_CheckExact(scale_arg)) ||
      !PyBool_Check(validate_arg) || (nodes_arg != Py_None && !PyLong_CheckExact(nodes_arg)) ||
      !plain_tensors(args + 8, 1, /*optional=*/true))
    Py_RETURN_NOTIMPLEMENTED;
  std::optional<int64_t> tree_nodes;
  if (nodes_arg != Py_None) {
    const long long nodes = PyLong_AsLongLong(nodes_arg);
    if (nodes == -1 && PyErr_Occurred()) return nullptr;
    tree_nodes = nodes;
  }
  const at::Tensor& q = THPVariable_Unpack(args[0]);
  // the wrapper's default, 1 / sqrt(D) in double (q is 4-d or the op's checks reject it anyway)
  const double scale = scale_arg != Py_None ? PyFloat_AS_DOUBLE(scale_arg)
                       : q.dim() > 0        ? 1.0 / std::sqrt(static_cast<double>(q.size(-1)))
                                            : 1.0;
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("taps_ops::tree_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, double, bool, std::optional<int64_t>,
                            const std::optional<at::Tensor>&)>();
  const at::Tensor &k = THPVariable_Unpack(args[1]), &v = THPVariable_Unpack(args[2]);
  const at::Tensor &tree_mask = THPVariable_Unpack(args[3]), &kv_lens = THPVariable_Unpack(args[4]);
  std::optional<at::Tensor> num_queries;
  if (queries_arg != Py_None) num_queries = THPVariable_Unpack(queries_arg);
  const bool grad = needs_grad({&q, &k, &v, &tree_mask, &kv_lens});
  at::Tensor out = call_typed(grad, [&] {
    return op.call(q, k, v, tree_mask, kv_lens, scale, validate_arg == Py_True, tree_nodes, num_queries);
  });
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

// taps_ops._C.panel_linear(x, panels, bias): a product of a few rows costs 2-5 us, of which torch.ops' own
// argument handling was 0.5-0.6 us more than torch.mm's (bench/RESULTS.md).
PyObject* panel_linear_py(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "taps_ops._C.panel_linear takes 3 positional arguments");
    return nullptr;
  }
  if (!plain_tensors(args, 2) || !plain_tensors(args + 2, 1, /*optional=*/true) ||
      at::impl::torch_function_mode_enabled())
    Py_RETURN_NOTIMPLEMENTED;
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("taps_ops::panel_linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  const at::Tensor &x = THPVariable_Unpack(args[0]), &panels = THPVariable_Unpack(args[1]);
  std::optional<at::Tensor> bias;
  if (args[2] != Py_None) bias = THPVariable_Unpack(args[2]);
  const bool grad = needs_grad({&x, &panels, bias ? &*bias : nullptr});
  at::Tensor out = call_typed(grad, [&] { return op.call(x, panels, bias); });
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

// A Python int (not a bool) as int64 into `out`; false for anything else (the caller returns NotImplemented).
bool exact_int(PyObject* o, int64_t& out) {
  if (!PyLong_CheckExact(o)) return false;
  const long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  out = v;
  return true;
}

// taps_ops._C.decoder_layer(x, emb, weights, eps, dims, cos, sin, keys, values, write_start, tree_mask, kv_lens,
// tree_nodes, scale, write_positions, rows): the engine calls it once per layer per step; torch.ops' schema parsing
// and boxing of its 16 arguments (a list of 11 optional tensors among them) cost ~20 us a call, as much as a
// one-row layer's four products on the shipped target (bench/RESULTS.md). Lists must be exact lists (of exact
// tensors or None, floats, ints), else NotImplemented.
PyObject* decoder_layer_py(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 16) {
    PyErr_SetString(PyExc_TypeError, "taps_ops._C.decoder_layer takes 16 positional arguments");
    return nullptr;
  }
  PyObject *weights_arg = args[2], *eps_arg = args[3], *dims_arg = args[4];
  if (at::impl::torch_function_mode_enabled() || !plain_tensors(args, 1) || !plain_tensors(args + 1, 1, true) ||
      !plain_tensors(args + 5, 4) || !plain_tensors(args + 10, 2) || !plain_tensors(args + 14, 2, true) ||
      !PyList_CheckExact(weights_arg) || !PyList_CheckExact(eps_arg) || !PyList_CheckExact(dims_arg) ||
      !PyFloat_CheckExact(args[13]))
    Py_RETURN_NOTIMPLEMENTED;
  int64_t write_start = 0;
  if (!exact_int(args[9], write_start)) Py_RETURN_NOTIMPLEMENTED;
  std::optional<int64_t> tree_nodes;
  if (args[12] != Py_None) {
    int64_t nodes = 0;
    if (!exact_int(args[12], nodes)) Py_RETURN_NOTIMPLEMENTED;
    tree_nodes = nodes;
  }
  const Py_ssize_t num_weights = PyList_GET_SIZE(weights_arg);
  if (!plain_tensors(PySequence_Fast_ITEMS(weights_arg), static_cast<int>(num_weights), true))
    Py_RETURN_NOTIMPLEMENTED;
  c10::List<std::optional<at::Tensor>> weights;
  weights.reserve(static_cast<size_t>(num_weights));
  bool grad_inputs = false;
  for (Py_ssize_t i = 0; i < num_weights; ++i) {
    PyObject* w = PyList_GET_ITEM(weights_arg, i);
    if (w == Py_None) {
      weights.push_back(std::nullopt);
    } else {
      const at::Tensor& t = THPVariable_Unpack(w);
      grad_inputs = grad_inputs || t.requires_grad();
      weights.push_back(t);
    }
  }
  std::vector<double> eps(static_cast<size_t>(PyList_GET_SIZE(eps_arg)));
  for (size_t i = 0; i < eps.size(); ++i) {
    PyObject* e = PyList_GET_ITEM(eps_arg, static_cast<Py_ssize_t>(i));
    if (!PyFloat_CheckExact(e)) Py_RETURN_NOTIMPLEMENTED;
    eps[i] = PyFloat_AS_DOUBLE(e);
  }
  std::vector<int64_t> dims(static_cast<size_t>(PyList_GET_SIZE(dims_arg)));
  for (size_t i = 0; i < dims.size(); ++i)
    if (!exact_int(PyList_GET_ITEM(dims_arg, static_cast<Py_ssize_t>(i)), dims[i])) Py_RETURN_NOTIMPLEMENTED;
  using OptTensor = std::optional<at::Tensor>;
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("taps_ops::decoder_layer", "")
          .typed<at::Tensor(const at::Tensor&, const OptTensor&, const c10::List<OptTensor>&, at::ArrayRef<double>,
                            at::IntArrayRef, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            int64_t, const at::Tensor&, const at::Tensor&, std::optional<int64_t>, double,
                            const OptTensor&, const OptTensor&)>();
  auto optional = [&](PyObject* o) -> OptTensor {
    if (o == Py_None) return std::nullopt;
    return THPVariable_Unpack(o);
  };
  const at::Tensor& x = THPVariable_Unpack(args[0]);
  const OptTensor emb = optional(args[1]), write_positions = optional(args[14]), rows = optional(args[15]);
  const at::Tensor &cos = THPVariable_Unpack(args[5]), &sin = THPVariable_Unpack(args[6]);
  const at::Tensor &keys = THPVariable_Unpack(args[7]), &values = THPVariable_Unpack(args[8]);
  const at::Tensor &tree_mask = THPVariable_Unpack(args[10]), &kv_lens = THPVariable_Unpack(args[11]);
  const double scale = PyFloat_AS_DOUBLE(args[13]);
  const bool grad = at::GradMode::is_enabled() &&
                    (grad_inputs || needs_grad({&x, emb ? &*emb : nullptr, &cos, &sin, &keys, &values}));
  at::Tensor out = call_typed(grad, [&] {
    return op.call(x, emb, weights, eps, dims, cos, sin, keys, values, write_start, tree_mask, kv_lens, tree_nodes,
                   scale, write_positions, rows);
  });
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

PyMethodDef module_methods[] = {
    {"tree_attention", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(tree_attention_py)),
     METH_FASTCALL, "tree_attention through the dispatcher's typed call (see taps_ops.tree_attention)"},
    {"panel_linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(panel_linear_py)), METH_FASTCALL,
     "panel_linear through the dispatcher's typed call (see taps_ops.panel_linear)"},
    {"decoder_layer", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(decoder_layer_py)), METH_FASTCALL,
     "decoder_layer through the dispatcher's typed call (see taps_ops.decoder_layer)"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

extern "C" {
// `import taps_ops._C` loads this shared library, whose static initialisers register the ops; the module's
// functions are the wrappers' fast entries to tree_attention, panel_linear and decoder_layer.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, module_methods};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(taps_ops, m) {
  // logits [B, N, V] f32/bf16/f16; tokens, parents [B, N] i64; temperature [B] f32;
  // top_k [B] i64 (0 = off); top_p [B] f32; draft_probs [B, N, V] f32/bf16/f16 or None;
  // uniforms [B, N] f32 in [0, 1) (validate: tree structure, parameter ranges, uniforms, NaN / inf
  // logits at visited nodes; the CPU kernel skips them too, its walk stays in bounds without them).
  // -> out_tokens [B, N] i64 (-1 padded), num_accepted [B] i64, path [B, N] i64 (-1 padded)
  m.def(
      "verify_tree(Tensor logits, Tensor tokens, Tensor parents, Tensor temperature, Tensor top_k, "
      "Tensor top_p, Tensor? draft_probs, Tensor uniforms, bool validate) -> (Tensor, Tensor, Tensor)");
  // scores [B, M] f32; tokens, parents [B, M] i64 (parent -1 = child of the root; token < 0 marks
  // a padding candidate, which is never kept);
  // root_tokens [B] i64 or None.
  // -> tokens, parents, depth [B, num_nodes] i64, tree_mask [B, num_nodes, W] i64,
  //    scores [B, num_nodes] f32, candidate_index [B, num_nodes] i64
  m.def(
      "build_tree(Tensor scores, Tensor tokens, Tensor parents, int num_nodes, Tensor? root_tokens, "
      "bool validate=True) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // tokens, parents [B, T, N] i64; scores [B, T, N] f32; weights [B, T] f32 (log-weights) or None.
  // -> tokens, parents, depth [B, num_nodes] i64, tree_mask [B, num_nodes, W] i64,
  //    scores [B, num_nodes] f32, source [B, num_nodes] i64 (bit t = drafter t proposed the node)
  m.def(
      "merge_trees(Tensor tokens, Tensor parents, Tensor scores, int num_nodes, Tensor? weights, "
      "bool validate=True) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // q [B, Hq, N, D]; k, v [B, Hkv, S, D]; tree_mask [B, N, W] i64; kv_lens [B] i64 -> out [B, Hq, N, D]
  // (validate: the kv_lens and num_queries range checks; the kernels clamp both anyway); tree_nodes T >= N
  // (None: N): the last T keys are tree nodes, masked by the N queries' rows; num_queries [B] i64 (None: N
  // each): request b's queries 0 .. num_queries[b] - 1 only, its other rows of out zeros.
  m.def(
      "tree_attention(Tensor q, Tensor k, Tensor v, Tensor tree_mask, Tensor kv_lens, float scale, "
      "bool validate=True, int? tree_nodes=None, Tensor? num_queries=None) -> Tensor");
  // caches: per layer K and V tensors [B, H, S, D], updated in place; path [B, P] i64 (-1 padded,
  // path[:, 0] == 0); prefix_lens [B] i64: cache position of tree node i is prefix_lens[b] + i
  // (validate: the path checks; the kernels leave a request with an invalid path untouched anyway).
  m.def("compact_kv(Tensor(a!)[] caches, Tensor path, Tensor prefix_lens, bool validate=True) -> ()");
  // x [..., H] f32/bf16/f16; weight [H] or [G, H] of x's dtype (G divides the rows of x; row r uses
  // weight row r / (rows / G)) -> out, x's shape and dtype: Llama's RMSNorm
  // round(round(x * rsqrt(mean(x^2) + eps)) * weight), the sum of squares in float32 in the fixed order of
  // taps/rms_norm.h (no data checks, so no validate flag).
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // x [R, T, H, D] (D even; any strides, last dimension contiguous), rotated in place; cos, sin [R, T, D] or
  // [R, T, 1, D] of x's dtype (sin with rotate_half's sign folded in): x = x * cos + x.roll(D / 2, -1) * sin
  // with each product and the sum rounded to x's dtype (taps/rope.h). No data checks, so no validate flag.
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  // One level of an EAGLE-2 expansion (taps/expand_level.h): logits [R, F, V] f32/bf16/f16 of the F
  // frontier nodes; front_scores [R, F] f32 (their cumulative log-probs); front_cands [R, F] i64 (their
  // candidate indices, -1 for the root); 1 <= k <= min(V, 64) children per node; 0 <= next_k <= F * k;
  // token_map [V] i64 (draft -> target ids) or None. No data checks, so no validate flag.
  // -> scores [R, F * k] f32, tokens, parents [R, F * k] i64, entropy [R] f32 (0 without with_entropy),
  //    next_scores [R, next_k] f32, next_tokens, next_slots (parent frontier slot), next_cands [R, next_k] i64
  m.def(
      "expand_level(Tensor logits, Tensor front_scores, Tensor front_cands, int k, int next_k, int cand_offset, "
      "Tensor? token_map, bool with_entropy) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // One Llama decoder layer of the lean forward path, attention through tree_attention over a cache
  // (composite/decoder_layer.cpp; one implementation for every device). x [G, R * T, H] f32/bf16 (G stacked weight
  // sets); emb [G, R * T, H] (EAGLE-3: the embedding the attention reads beside x) or None; weights: 11
  // entries (in_norm, hidden_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, gate_up_bias, down,
  // down_bias; linear weights [out, in], oneDNN-packed [out, in] or stacked [G, in, out]); eps [in_norm,
  // hidden_norm, post_norm]; dims [heads, kv_heads, head_dim, fused_rope]; cos, sin [G * R, T, 1, D];
  // keys, values [G * R, Hkv, S, D], the new K/V written at columns write_start .. write_start + T - 1, or,
  // with write_positions [G * R, T] i64, at each row's own columns (ragged rows; write_start ignored);
  // tree_mask, kv_lens, tree_nodes, scale as tree_attention's. Packed (rows [M] i64, G = 1): x [1, M, H] holds
  // M of the R x T token slots (slot r * T + t; T = tree_mask.size(1)), cos / sin [1, M, 1, D], write_positions
  // [M] their cache columns; the other slots are neither computed nor written. -> the layer's output, x's shape.
  m.def(
      "decoder_layer(Tensor x, Tensor? emb, Tensor?[] weights, float[] eps, int[] dims, Tensor cos, Tensor sin, "
      "Tensor(a!) keys, Tensor(b!) values, int write_start, Tensor tree_mask, Tensor kv_lens, int? tree_nodes, "
      "float scale, Tensor? write_positions=None, Tensor? rows=None) -> Tensor");
  // x [..., in] f32 times a float32 or bfloat16 weight [out, in] kept as panels [out / 16, in, 16] (panel p holds
  // outputs 16p .. 16p + 15, taps_ops.pack_panels), plus bias [out] f32 or None -> [..., out] f32. Each output's
  // sum runs from i = 0 up in float32 (bf16 weights widened as read), one fused multiply-add per term: the same
  // bits at every ISA level, row count and thread count. bf16 x over bf16 panels -> [..., out] bf16, the float32
  // sums rounded once (AVX512-BF16's dot products at the avx512 level where the CPU has them: the same bits).
  // CPU only (cpu/panel_linear.cpp); no data checks, so no validate flag.
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias=None) -> Tensor");
  // The argmax of panel_linear(x, panels) per row (ties to the lowest id), bit for bit, from an int8 screen of the
  // same weight: screen [out / 16, ceil(in / 4), 16, 4] i8, meta [3, out] f32 (scales, the screen's row sums and
  // |row|_1: taps_ops.pack_head_screen); x [..., in] f32 (or bf16 over bf16 panels) -> [...] i64. CPU only
  // (cpu/head_argmax.cpp).
  m.def("head_argmax(Tensor x, Tensor screen, Tensor meta, Tensor panels) -> Tensor");
  // A token store's continuation of a context (cpu/token_store.cpp; host data, CPU only): tokens [L] i32 (-1
  // between sequences), ends [M] i64, cols [K, M] i32 (the reversed suffix array taps.drafters.store builds);
  // context: the context's last tokens -> [n, lo, hi, continuation...]: the longest suffix matched (<= K
  // tokens), its range of ends, and (n >= min_ngram) up to depth tokens voted over its first `vote` occurrences.
  m.def(
      "token_store_continuation(Tensor tokens, Tensor ends, Tensor cols, int[] context, int depth, int min_ngram, "
      "int vote) -> int[]");
  // An n-gram table's logits for context rows (cpu/ngram_table.cpp; host data, CPU only): keys [K] i64 (uint64
  // bits, sorted as uint64), counts [K] i64, starts [K + 1] i64, ids [E] i64, logp [E] f32 (the table
  // taps.drafters.table builds), contexts [R, W] i64 (-1: shorter) -> [R, vocab] f32: floor, and the entries of
  // each row's longest context held (<= max_order tokens, counts >= min_count; order 0, key 0, when none).
  m.def(
      "ngram_table_logits(Tensor keys, Tensor counts, Tensor starts, Tensor ids, Tensor logp, Tensor contexts, "
      "int vocab, int max_order, int min_count, float floor) -> Tensor");
  // Sampled chains from the same table: width draws at each request's root (contexts row b), each continued by one
  // draw a level to depth levels, q = softmax(logp / temperature[b]) over a node's context's entries; uniforms
  // [B, width * depth] f32 -> tokens, parents [B, M] i64, scores [B, M] f32 (cumulative log q), probs
  // [B, 1 + M, vocab] f32 (the q each node's children were drawn from; M = width * depth), written into `out`
  // when given (cleared first).
  m.def(
      "ngram_table_draw(Tensor keys, Tensor counts, Tensor starts, Tensor ids, Tensor logp, Tensor contexts, "
      "Tensor uniforms, Tensor temperature, int width, int depth, int vocab, int max_order, int min_count, "
      "Tensor? out=None) -> (Tensor, Tensor, Tensor, Tensor)");
  // The CPU kernels' instruction-set level (cpu/cpu_isa.h): scalar, avx2, avx512 or amx. _cpu_isa: the one in
  // force; _cpu_host_isa: the best this CPU runs; _set_cpu_isa(level): cap the kernels there (<= the host's),
  // returns the level in force; _cpu_features: the CPU features the kernels look at. No tensors: catch-all.
  m.def("_cpu_isa() -> str", &taps::cpu::cpu_isa_op);
  m.def("_cpu_host_isa() -> str", &taps::cpu::cpu_host_isa_op);
  m.def("_set_cpu_isa(str level) -> str", &taps::cpu::set_cpu_isa_op);
  m.def("_cpu_features() -> str[]", &taps::cpu::cpu_features_op);
  // _cpu_peak_flops(level): FLOP/s of one core's fp32 multiply-adds at that level, measured (a few ms).
  m.def("_cpu_peak_flops(str level) -> float", &taps::cpu::cpu_peak_flops_op);
  // _set_panel_prefetch(lines): panel_linear's software prefetch distance (-1: by the weight's size, the
  // default; 0: never; N: always N cache lines); returns the previous setting (cpu/panel_linear.cpp).
  m.def("_set_panel_prefetch(int lines) -> int", &taps::set_panel_prefetch_op);
  // _set_panel_next(on): whether panel_linear's row blocks after the first prefetch the next output block, or after
  // the last block the first of the panels decoder_layer multiplies next (the default: on); returns the previous
  // setting (cpu/panel_linear.cpp).
  m.def("_set_panel_next(bool on) -> bool", &taps::set_panel_next_op);
}
