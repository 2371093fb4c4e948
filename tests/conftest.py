"""Settings, seeds and helpers shared by every test module.

CPU and strict rank promotion. float64 references are computed in numpy, so jax stays in its
default 32-bit mode here, as in runs.

Random inputs come from one session seed: $KDJAX_TEST_SEED, else drawn at random. pytest's header
prints it (without -q), and a failing test that drew from it reports it with the command that
replays it: `KDJAX_TEST_SEED=<n> pytest <test id>`. A test's own seed (fixtures `seed`, `rng`)
hashes the session seed with the test's id; `module_rng` does so with the module's id, for
module-scoped fixtures.

Helpers of several test modules are fixtures, so no test module imports another: sequence stores
and teacher caches here; the float64 loss reference and the Hugging Face side venv in the plugins
tests/fixtures/loss_reference.py and hf_side.py.

Letters: B batch, T positions, V vocabulary, D width, K top-k entries.
"""
import hashlib
import json
import os
import secrets

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kdjax import cache, teacher  # noqa: E402
from tests.fixtures.shared import shared  # noqa: E402
from tests.fixtures.stand_in import StandIn  # noqa: E402
from tests.fixtures.stores import store_files  # noqa: E402

# --- Seeds -------------------------------------------------------------------------------------

SEED_ENV = "KDJAX_TEST_SEED"
SESSION_SEED = pytest.StashKey[int]()


def pytest_configure(config):
  value = os.environ.get(SEED_ENV) or str(secrets.randbits(32))
  try:
    seed = int(value)
  except ValueError:
    raise pytest.UsageError(f"{SEED_ENV}={value!r}: give an integer (or unset it)") from None
  # xdist workers (started after this) and test subprocesses inherit it: one seed per session.
  os.environ[SEED_ENV] = str(seed)
  config.stash[SESSION_SEED] = seed


# The fast subset (`-m "not slow"`) also leaves out these tests, each of which took over 10 s
# (2026-12-03), over 7 s, or over 6.8 s on a slower day (2026-12-07), most of it compiling, on 2
# busy cores (`pytest -n 2 -m "not slow" --durations=60`): the whole suite runs them. file ->
# test functions (every parametrisation), or single parametrisations by test id ("name[id]")
# where the fast subset keeps one of them.
HEAVY = {
    "test_attention.py": ("test_documents_in_several_cudnn_calls",
                          "test_einsum_attention_in_query_blocks",
                          "test_one_document_rows_through_cudnn"),
    "test_cache.py": ("test_the_notebook_decodes_a_cache",),
    "test_cache_floor.py": ("test_tables_of_a_tiny_synthetic_teacher",),
    "test_checkpoints.py": ("test_checkpoint_from_before_a_model_field_existed_restores",
                            "test_restore_finished_reads_the_parameters_only"),
    "test_completion.py": ("test_greedy_exact_match_agrees_with_a_plain_loop",),
    "test_evaluate.py": ("test_matches_dense_float64_reference",
                         "test_online_matches_dense_float64_reference",
                         "test_fresh_and_restored_models_share_one_program",
                         "test_every_batch_shares_one_program"),
    "test_experiments.py": ("test_step_floor_from_the_committed_results", "test_help"),
    "test_fused.py": ("test_pallas_fused_path_large_logits_and_few_rows",
                      "test_pallas_fused_path_matches_float64[tail-2.0-0.0]",
                      "test_pallas_fused_path_matches_float64[sparse-1.0-0.3]",
                      "test_pallas_fused_path_matches_float64[renorm-1.0-0.3]"),
    "test_grouped.py": ("test_moe_through_kernels_matches_reference",
                        "test_kernels_match_float64[f16-KxN]"),
    "test_hf.py": "all",  # its Hugging Face checkpoints take minutes to build in the side venv
    "test_hf_checkpoint.py": ("test_bad_shards", "test_export_over_previous_export_with_tokenizer",
                              "test_bfloat16_and_sharded_export", "test_export_load_round_trip",
                              "test_export_refuses_models_no_family_has",
                              "test_loads_one_tensor_at_a_time", "test_bad_configs",
                              "test_bad_weights", "test_config_layouts_and_real_vocab",
                              "test_path_is_a_file_or_missing",
                              "test_export_writes_integer_fields_as_ints"),
    "test_hidden.py": ("test_step_loss_adds_the_weighted_term_and_trains_the_projection",
                       "test_teacher_caches_its_final_hidden_states",
                       "test_training_with_the_hidden_term"),
    "test_main_errors.py": ("test_user_error_is_one_message_without_traceback",),
    "test_models.py": ("test_jit_equals_eager", "test_bfloat16_close_to_float32",
                       "test_gqa_equals_mha_with_repeated_kv",
                       "test_every_remat_policy_gives_the_loss_and_gradients_of_none",
                       "test_causality_through_gradients",
                       "test_packed_documents_equal_separate_runs", "test_shapes_and_tying",
                       "test_which_policies_rerun_the_attentions_forward",
                       "test_real_vocab_drops_padding_rows"),
    "test_moe.py": ("test_packed_documents_equal_separate_runs",
                    "test_causality_through_gradients"),
    "test_mxfp4.py": ("test_packed_checkpoint_round_trip", "test_packed_logits_equal_dequantised",
                      "test_transformers_decodes_the_packed_checkpoint"),
    "test_prune.py": ("test_padding_does_not_count", "test_all_kept_is_the_teacher_exactly",
                      "test_fewer_layers_is_the_teacher_run_with_those_layers"),
    "test_reporting.py": ("test_non_finite_loss_names_the_step",),
    "test_resume.py": ("test_nan_after_a_checkpoint_keeps_that_checkpoint_and_writes_none",
                       "test_crash_resumes_to_identical_parameters",
                       "test_checkpoint_of_another_model_shape_is_refused",
                       "test_finished_run_is_not_trained_again",
                       "test_metrics_are_exact_across_interruptions",
                       "test_a_checkpoint_in_the_older_state_layout_resumes",
                       "test_a_damaged_row_stops_training_after_saving"),
    "test_swiglu.py": ("test_partitioned_op_keeps_the_rows_split",
                       "test_model_with_the_kernel_is_as_close_to_float32_as_xla"),
    "test_teacher.py": ("test_topk_matches_dense_reference",
                        "test_resume_after_a_crash_equals_an_uninterrupted_run",
                        "test_parallel_writers_write_the_same_bytes_and_resume"),
    "test_train.py": ("test_second_step_compiles_nothing",
                      "test_accumulation_matches_one_big_batch",
                      "test_online_objective_runs_the_teacher_beside_the_step",
                      "test_memory_levers_keep_the_update",
                      "test_distillation_loss_falls_and_logs",
                      "test_step_metrics_are_masked_means_of_the_dense_terms",
                      "test_fused_loss_impl_in_the_train_step",
                      "test_hard_label_loss_is_cross_entropy", "test_a_run_compiles_its_step_once",
                      "test_documents_bound_per_micro_batch"),
}


def pytest_collection_modifyitems(config, items):
  for item in items:
    heavy = HEAVY.get(item.path.name, ())
    if heavy == "all" or item.originalname in heavy or item.name in heavy:
      item.add_marker(pytest.mark.slow)


def pytest_report_header(config):
  return f"{SEED_ENV}={config.stash[SESSION_SEED]} (random inputs derive from it; set it to replay)"


def derive_seed(session_seed: int, nodeid: str) -> int:
  """A 32-bit seed from the session seed and a test's (or module's) id, alike in every process."""
  digest = hashlib.sha256(f"{session_seed}:{nodeid}".encode()).digest()
  return int.from_bytes(digest[:4], "little")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  report = yield
  if report.failed and "session_seed" in getattr(item, "fixturenames", ()):
    seed = item.config.stash[SESSION_SEED]
    own = f"; its seed {derive_seed(seed, item.nodeid)}" if "seed" in item.fixturenames else ""
    text = (f"session seed {seed}{own}; to replay, from the repository root:\n"
            f"  {SEED_ENV}={seed} pytest '{item.nodeid}'")
    report.sections.append(("random inputs", text))
  return report


def pytest_terminal_summary(terminalreporter, config):
  """The seed once more at the end, for -q runs (no header) with failures that drew from it."""
  reports = terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", [])
  if any(name == "random inputs" for report in reports for name, _ in report.sections):
    seed = config.stash[SESSION_SEED]
    terminalreporter.write_line(f"{SEED_ENV}={seed} replays the random inputs of these failures")


@pytest.fixture(scope="session")
def session_seed(pytestconfig) -> int:
  return pytestconfig.stash[SESSION_SEED]


@pytest.fixture
def seed(request, session_seed) -> int:
  return derive_seed(session_seed, request.node.nodeid)


@pytest.fixture
def rng(seed) -> np.random.Generator:
  return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def module_rng(request, session_seed) -> np.random.Generator:
  return np.random.default_rng(derive_seed(session_seed, request.node.nodeid))


# --- Helpers of several test modules ------------------------------------------------------------

pytest_plugins = ["tests.fixtures.loss_reference", "tests.fixtures.hf_side"]


# --- Compiled programs shared by the kdjax.main runs of a test module ----------------------------


@pytest.fixture(scope="module")
def main_compile_cache(tmp_path_factory) -> tuple[list[str], dict[str, str]]:
  """The flag and environment that make `python -m kdjax.main` runs share one folder of compiled
  programs, every program kept however fast it compiled: most of a smoke run on CPU is
  compiling, and a module's runs compile the same programs. One folder per module, so per
  xdist worker (JAX writes its entries without a lock). Only process 0 of a run writes."""
  path = tmp_path_factory.mktemp("compile_cache")
  return [f"--config.compile_cache={path}"], {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


# --- Sequence stores (the cache tests) ----------------------------------------------------------

STORE_V, STORE_T, STORE_K = 300, 8, 5


def make_rows(rng, n, seq_len=STORE_T, k=STORE_K, vocab=STORE_V):
  """Valid rows: top-k log-probs sorted descending, like lax.top_k output."""
  rows = {"tokens": rng.integers(0, vocab, (n, seq_len), dtype=np.int32),
          "segment_ids": np.ones((n, seq_len), np.int32),
          "positions": np.tile(np.arange(seq_len, dtype=np.int32), (n, 1)),
          "loss_mask": rng.random((n, seq_len)) < 0.9}
  if k:
    rows["topk_ids"] = rng.integers(0, vocab, (n, seq_len, k), dtype=np.int32)
    rows["topk_logprobs"] = -np.sort(rng.exponential(3.0, (n, seq_len, k)), -1).astype(np.float32)
  return rows


def new_store(path, num_seqs=10, k=STORE_K, layout_name="float32", attrs=None, region_rows=4):
  return cache.create(path, num_seqs=num_seqs, seq_len=STORE_T, k=k, vocab_size=STORE_V,
                      attrs=attrs or {"teacher_hash": "t1", "tokenizer_hash": "tok1"},
                      layout=layout_name, region_rows=region_rows)


def take(rows, index):
  return {name: arr[index] for name, arr in rows.items()}


make_rows_fixture = shared("make_rows", make_rows)
new_store_fixture = shared("new_store", new_store)
take_fixture = shared("take", take)


@pytest.fixture
def store_and_rows(tmp_path):
  """A finished compact store of 10 rows in 3 regions, and its rows."""
  rows = make_rows(np.random.default_rng(0), 10)
  new_store(tmp_path / "s", layout_name="compact").write(0, rows)
  return cache.open(tmp_path / "s"), rows


# --- Teacher caches (the teacher and cache fault tests) -----------------------------------------

TEACHER_V, TEACHER_T, TEACHER_D, TEACHER_K = 61, 12, 16, 7


def make_data(path, num_seqs=10, region_rows=3, seed=0):
  rng = np.random.default_rng(seed)
  store = cache.create(path, num_seqs=num_seqs, seq_len=TEACHER_T, k=0, vocab_size=TEACHER_V,
                       attrs={"tokenizer_hash": "tok", "source": "test"}, region_rows=region_rows)
  segment_ids = np.ones((num_seqs, TEACHER_T), np.int32)
  segment_ids[0, TEACHER_T - 3:] = 0  # padding tail
  store.write(0, {"tokens": rng.integers(0, TEACHER_V, (num_seqs, TEACHER_T), dtype=np.int32),
                  "segment_ids": segment_ids,
                  "positions": np.tile(np.arange(TEACHER_T, dtype=np.int32), (num_seqs, 1)),
                  "loss_mask": segment_ids > 0})
  return cache.open(path)


def write(model, data, path, **kw):
  # One writer thread unless a test asks for more: the fault tests count regions in order.
  kw = {"k": TEACHER_K, "batch_size": 4, "chunk_size": 5, "vocab_size": TEACHER_V,
        "attrs": {"teacher_hash": "tiny"}, "writers": 1, **kw}
  return teacher.write_cache(model, data, path, **kw)


def TinyTeacher():
  """tests/fixtures/stand_in.py's two-matrix teacher at this module's sizes."""
  return StandIn(TEACHER_V, TEACHER_D)


make_data_fixture = shared("make_data", make_data)
write_fixture = shared("write", write)
store_files_fixture = shared("store_files", store_files)
tiny_teacher_fixture = shared("tiny_teacher", TinyTeacher)


# --- A transformers-5 checkpoint's tokenizer (the tokenizer, data and checks tests) -------------

# SmolLM2-135M-Instruct's chat template, verbatim (ChatML with a default system turn).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
SMOLLM2_TEXTS = ["Hello there! You are a helpful assistant.", "def f(x):\n    return x + 1\n",
                 "The quick brown fox jumps over the lazy dog. 2 + 2 = 4."] * 20


def smollm2_tokenizer(path) -> str:
  """A tiny tokenizer laid out as transformers 5 converts SmolLM2-135M-Instruct (from GGUF): a
  byte-level BPE with <|endoftext|> (id 0, the document separator), <|im_start|> (1, configured
  as bos) and <|im_end|> (2, eos and pad); tokenizer_config.json without a chat template, which
  is in chat_template.jinja. Returns the directory."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  hf = tokenizers.Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  hf.decoder = decoders.ByteLevel()
  hf.train_from_iterator(SMOLLM2_TEXTS, trainer=trainers.BpeTrainer(
      vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  os.makedirs(path, exist_ok=True)
  hf.save(os.path.join(path, "tokenizer.json"))
  config = {"backend": "tokenizers", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
            "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>",
            "tokenizer_class": "TokenizersBackend"}
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  with open(os.path.join(path, "chat_template.jinja"), "w") as f:
    f.write(SMOLLM2_TEMPLATE)
  return str(path)


smollm2_tokenizer_fixture = shared("smollm2_tokenizer", smollm2_tokenizer)
smollm2_template_fixture = shared("smollm2_template", SMOLLM2_TEMPLATE)
