"""The Hugging Face transformers integration (sparse_flash.integrations.transformers), on tiny random models.

Nothing is downloaded: a Llama-style causal LM (GQA) and BERT / ModernBERT encoders are built from configs
(2 layers, width 64, 256 to 1,000 tokens). The reference is the same model through attn_implementation="sdpa":
in float64 as the oracle, and in the tested dtype as the baseline of the 2x error rule (sparse_flash.testing). A
sparse pattern is compared with SDPA given the materialised mask (the pattern, the causal rule and the padding).
"""

import copy
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from sparse_flash import masks  # noqa: E402
from sparse_flash.integrations.transformers import CallPlan, plan_call, prepare, register  # noqa: E402
from sparse_flash.testing import Comparison, max_error  # noqa: E402

from conftest import DEVICE, HAS_CUDA, triton_usable  # noqa: E402

NAME = register()
ROOT = Path(__file__).resolve().parents[1]
VOCAB = 128
LOCAL = {"pattern": "local", "block_size": 64, "window": 1, "backend": "torch"}  # rows do not change with the length
BIGBIRD = {"pattern": "bigbird", "block_size": 64, "num_heads": 4, "seed": 3, "backend": "torch"}


def llama_config(**changes):
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return transformers.LlamaConfig(**{**values, **changes})


def bert_config(**changes):
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=1024, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertConfig(**{**values, **changes})


def modernbert_config(**changes):
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=1024, layer_types=["full_attention"] * 2, pad_token_id=0, eos_token_id=1,
                  bos_token_id=2, cls_token_id=2, sep_token_id=1)
    return transformers.ModernBertConfig(**{**values, **changes})


MODELS = {
    "llama": (llama_config, transformers.LlamaForCausalLM, True),
    "bert": (bert_config, transformers.BertForMaskedLM, False),
    "modernbert": (modernbert_config, transformers.ModernBertForMaskedLM, False),
}


def pair(kind, spec=None, **changes):
    """(sdpa model, sparse_flash model) with the same random weights, in eval mode."""
    make_config, cls, _ = MODELS[kind]
    torch.manual_seed(0)
    sdpa = cls._from_config(make_config(**changes), attn_implementation="sdpa").eval()
    ours = copy.deepcopy(sdpa)
    ours.set_attn_implementation(NAME)
    ours.config.sparse_flash = spec
    return sdpa, ours


def tokens(batch, length, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def element_mask(spec_config, length, causal, keep=None):
    """The materialised mask SDPA takes: pattern, causal rule and padding, bool `(B|1, H|1, L, L)`."""
    pattern = prepare(spec_config, length)
    allowed = torch.ones(1, 1, length, length, dtype=torch.bool) if pattern is None else pattern.to_dense()
    if causal:
        allowed = allowed & torch.ones(length, length, dtype=torch.bool).tril()
    if keep is not None:
        allowed = allowed & keep.bool()[:, None, None, :]
    return allowed


def run(model, ids, dtype, attention_mask=None):
    """Logits and the gradients of every parameter (one flat vector) of a cross-entropy loss."""
    model = copy.deepcopy(model).to(dtype)
    out = model(ids, attention_mask=attention_mask)
    logits = out.logits
    target = torch.roll(ids, -1, dims=1)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), target.reshape(-1))
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    flat = torch.cat([g.reshape(-1) for g in grads if g is not None])
    return {"logits": logits.detach(), "grads": flat}


def assert_2x(ours: dict, baseline: dict, reference: dict, dtype=torch.float32):
    """The 2x rule: our error against the float64 reference is at most twice the baseline's (same dtype), plus the
    floor of sparse_flash.testing (1e-5 in float32, half an ulp in 16 bits, of the largest reference value)."""
    result = Comparison()
    for name, ref in reference.items():
        result.errors[name] = max_error(ours[name], ref)
        result.baseline[name] = max_error(baseline[name], ref)
        result.floors[name] = max(1e-5, torch.finfo(dtype).eps / 2) * max(float(ref.abs().max()), 1.0)
    assert not result.failures(), result.failures()


def check_against_sdpa(kind, spec, length, *, batch=1, keep=None, dtype=torch.float32, device="cpu", **changes):
    sdpa, ours = pair(kind, spec, **changes)
    ids = tokens(batch, length)
    causal = MODELS[kind][2]
    if spec is None and keep is None:
        ref_mask = None
    else:
        ref_mask = element_mask(ours.config, length, causal, keep)
    sdpa, ours, ids = sdpa.to(device), ours.to(device), ids.to(device)
    ref_mask = None if ref_mask is None else ref_mask.to(device)
    keep = None if keep is None else keep.to(device)
    reference = run(sdpa, ids, torch.float64, ref_mask)
    baseline = run(sdpa, ids, dtype, ref_mask)
    assert_2x(run(ours, ids, dtype, keep), baseline, reference, dtype)  # every row: padded rows are defined too


# ---------------------------------------------------------------------------------------------- register


def test_register_returns_the_name_and_is_idempotent():
    assert register() == NAME == "block_sparse"
    assert transformers.AttentionInterface._global_mapping[NAME] is not None
    assert transformers.masking_utils.AttentionMaskInterface._global_mapping[NAME] is not None


@pytest.mark.parametrize("name, error", [("sparse_flash", "must not contain 'flash'"),
                                         ("Flash_sparse", "must not contain 'flash'"),
                                         ("sdpa", "already has an attention implementation"),
                                         ("eager", "reserved"), ("", "non-empty")], ids=str)
def test_register_refuses_names(name, error):
    with pytest.raises((ValueError, TypeError), match=error):
        register(name)


def test_import_needs_torch_alone():
    code = ("import sys, sparse_flash, sparse_flash.integrations.transformers; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---------------------------------------------------------------------------------------------- against SDPA


@pytest.mark.parametrize("kind, length", [("llama", 1000), ("bert", 256), ("modernbert", 256)])
def test_dense_matches_sdpa(kind, length):
    check_against_sdpa(kind, None, length, batch=2)


@pytest.mark.parametrize("kind, spec", [
    ("llama", BIGBIRD),
    ("llama", {"pattern": "butterfly", "block_size": (64, 32), "backend": "torch"}),
    ("bert", {"pattern": "longformer", "block_size": 64, "backend": "reference"}),
    ("modernbert", BIGBIRD),
], ids=["llama-bigbird-per-head", "llama-butterfly-64x32", "bert-longformer", "modernbert-bigbird"])
def test_pattern_matches_sdpa_with_the_materialised_mask(kind, spec):
    check_against_sdpa(kind, spec, 300, batch=2)


@pytest.mark.skipif(not triton_usable(), reason="needs triton (the interpreter on the CPU)")
@pytest.mark.parametrize("kind, spec", [("llama", None), ("bert", {**BIGBIRD, "num_heads": None})],
                         ids=["llama-dense", "bert-bigbird"])
def test_triton_backend_matches_sdpa(kind, spec):
    spec = {"pattern": "dense", "block_size": 64} if spec is None else spec
    check_against_sdpa(kind, {**spec, "backend": "triton"}, 256, device=DEVICE)


def test_autocast_runs_in_its_dtype_like_sdpa():
    """Under autocast (here bf16 on the CPU) q and k leave rotary embeddings in float32 while v is bf16: the
    attention casts them like SDPA does, and is as exact as SDPA in that dtype."""
    sdpa, ours = pair("llama", None)
    ids = tokens(1, 256)
    with torch.no_grad():
        reference = {"logits": copy.deepcopy(sdpa).double()(ids).logits}
        with torch.autocast("cpu", torch.bfloat16):
            baseline, mine = ({"logits": m(ids).logits} for m in (sdpa, ours))
    assert mine["logits"].dtype == baseline["logits"].dtype == torch.bfloat16
    assert_2x(mine, baseline, reference, torch.bfloat16)


def test_callable_pattern_matches_the_named_pattern():
    sdpa, ours = pair("llama", LOCAL)
    ids = tokens(1, 256)
    with torch.no_grad():
        named = ours(ids).logits
        ours.config.sparse_flash = lambda n, device: masks.local(n, 64, window=1, device=device)
        built = ours(ids).logits
    torch.testing.assert_close(built, named, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- padding


def keep_mask(batch, length, *, right=(), left=()):
    """A 2-D padding mask: row b keeps its first `length - right[b]` keys and drops its first `left[b]`."""
    keep = torch.ones(batch, length, dtype=torch.long)
    for b, n in enumerate(right):
        keep[b, length - n:] = 0
    for b, n in enumerate(left):
        keep[b, :n] = 0
    return keep


@pytest.mark.parametrize("kind, spec, keep", [
    ("llama", None, keep_mask(3, 300, right=(0, 77, 299))),
    ("llama", None, keep_mask(3, 300, left=(0, 77, 299))),
    ("llama", BIGBIRD, keep_mask(3, 300, right=(0, 77, 300))),
    ("llama", LOCAL, keep_mask(2, 300, left=(128, 0))),
    ("bert", BIGBIRD, keep_mask(2, 300, right=(13, 0), left=(64, 0))),
    ("bert", None, keep_mask(2, 300, left=(5, 0), right=(10, 0))),
], ids=["llama-dense-right", "llama-dense-left", "llama-bigbird-right", "llama-local-left-blocks",
        "bert-bigbird-both", "bert-dense-both"])
def test_padding_matches_sdpa(kind, spec, keep):
    check_against_sdpa(kind, spec, 300, batch=keep.shape[0], keep=keep)


@pytest.mark.parametrize("spec, keep, error", [
    (BIGBIRD, keep_mask(2, 256, left=(37, 0)),
     r"attention_mask cannot be expressed exactly with the config.sparse_flash pattern: key block 0 \(keys 0..63\)"),
    (None, torch.tensor([[1] * 100 + [0] * 5 + [1] * 151]), "not one contiguous run"),
], ids=["pattern-left-padding-inside-a-block", "dense-hole"])
def test_padding_that_is_not_exact_is_refused(spec, keep, error):
    _, ours = pair("llama", spec)
    with pytest.raises(ValueError, match=error):
        ours(tokens(keep.shape[0], 256), attention_mask=keep)


# ---------------------------------------------------------------------------------------------- KV cache


GPU = pytest.mark.gpu
# The keyword that takes the KV cache: `past_key_values` up to transformers 5.2x, then `cache`.
CACHE_KW = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else \
    "past_key_values"
INTERPRETER = pytest.mark.skipif(HAS_CUDA or not triton_usable(), reason="the Triton interpreter runs on CPU machines")


@pytest.mark.parametrize("spec, device, end", [
    (None, "cpu", 260), (LOCAL, "cpu", 260),
    ({"pattern": "butterfly", "block_size": 32, "backend": "torch"}, "cpu", 260),
    pytest.param({**LOCAL, "backend": "triton"}, "cpu", 232, marks=INTERPRETER),
    pytest.param(None, "cuda", 260, marks=GPU), pytest.param({**LOCAL, "backend": "auto"}, "cuda", 260, marks=GPU),
], ids=["dense", "local", "butterfly", "local-interpreter", "dense-gpu", "local-gpu"])
def test_cache_chunks_and_decoding_match_one_forward(spec, device, end):
    """A prefill, a chunk (queries at the last positions of more keys) and decoding steps give the rows of one
    forward over the whole sequence (a pattern whose rows do not depend on the length)."""
    _, ours = pair("llama", spec)
    ours, ids = ours.to(device), tokens(2, end).to(device)
    with torch.no_grad():
        full = ours(ids).logits
        cache = transformers.DynamicCache(config=ours.config)
        steps = [ours(ids[:, :100], **{CACHE_KW: cache}).logits, ours(ids[:, 100:230], **{CACHE_KW: cache}).logits]
        steps += [ours(ids[:, i: i + 1], **{CACHE_KW: cache}).logits for i in range(230, end)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_generate_dense_matches_sdpa_greedy():
    sdpa, ours = pair("llama", None)
    ids, keep = tokens(2, 90), keep_mask(2, 90, left=(0, 17))  # batched prompts, left padded
    kwargs = dict(attention_mask=keep, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), sdpa.generate(ids, **kwargs))


def test_generate_with_a_pattern_agrees_across_caches():
    _, ours = pair("llama", LOCAL)
    ids = tokens(1, 120)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    dynamic = ours.generate(ids, **kwargs)
    assert torch.equal(ours.generate(ids, use_cache=False, **kwargs), dynamic)
    assert torch.equal(ours.generate(ids, cache_implementation="static", **kwargs), dynamic)


def test_plan_of_a_decoding_step_and_of_a_chunk():
    config = llama_config()
    config.sparse_flash = LOCAL
    step = plan_call(config, q_length=1, kv_length=300, q_offset=299, causal=True)
    assert (step.keys, step.pad_queries, step.causal) == (300, 0, False)
    assert step.groups[0].mask.shape[-2:] == (1, 5)
    chunk = plan_call(config, q_length=50, kv_length=512, q_offset=150, causal=True)  # a static cache of 512
    assert (chunk.keys, chunk.pad_queries, chunk.causal) == (200, 150, True)
    rows = chunk.groups[0].mask.layout[0, 0].any(dim=1).tolist()
    assert rows == [False, False, True, True]  # dummy block rows in front are empty


def test_a_plan_passes_for_a_prepared_mask():
    """generate with a static cache treats the plan as the 4-D mask it prepared: it reads `ndim` and (transformers
    5.20 and earlier 5.x) takes `contiguous()`, which must give the same plan back."""
    config = llama_config()
    config.sparse_flash = LOCAL
    plan = plan_call(config, q_length=50, kv_length=512, q_offset=150, causal=True)
    assert plan.ndim == 4 and plan.contiguous() is plan


def test_one_call_plan_per_forward_serves_every_layer(monkeypatch):
    _, ours = pair("llama", LOCAL)
    seen = []
    original = CallPlan.run

    def spy(self, *args):
        seen.append(self)
        return original(self, *args)

    monkeypatch.setattr(CallPlan, "run", spy)
    with torch.no_grad():
        ours(tokens(1, 128))
    assert len(seen) == 2 and seen[0] is seen[1]


def test_compiles_fullgraph_after_prepare():
    """prepare() checks the config and builds the mask outside the graph; the compiled model needs nothing else."""
    _, ours = pair("llama", dict(LOCAL))
    ids = tokens(1, 256)
    with torch.no_grad():
        eager = ours(ids).logits
        ours.config.sparse_flash = dict(LOCAL)  # a value no eager call has checked
        compiled = torch.compile(ours, backend="eager", fullgraph=True)
        with pytest.raises(Exception, match=r"prepare\(config, seq_len, device\)"):
            compiled(ids)
        torch._dynamo.reset()
        prepare(ours.config, 256)
        torch.testing.assert_close(compiled(ids).logits, eager, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- training


def test_training_steps_run_and_learn():
    _, ours = pair("llama", BIGBIRD)
    ours.train()
    ids = tokens(2, 256)
    optimizer = torch.optim.AdamW(ours.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        loss = ours(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_cpu_smoke_demo_runs():
    sys.path.insert(0, str(ROOT / "demos"))
    try:
        import hf_long_context
    finally:
        sys.path.pop(0)
    rows = hf_long_context.main(["--cpu-smoke", "--out", ""])
    assert {r["attention"] for r in rows} == {"sdpa", "block_sparse"}
    assert all(r["samples_per_s"] > 0 and r["final_loss"] == r["final_loss"] for r in rows)


@pytest.mark.parametrize("flags, words", [
    (["--steps", "0"], "--steps must be at least 1"), (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--width", "0"], "--width must be at least 1"), (["--layers", "0"], "--layers must be at least 1"),
    (["--vocab", "0"], "--vocab must be at least 1"), (["--warmup", "-1"], "--warmup must be at least 0"),
    (["--heads", "3"], "times an even head dimension"), (["--kv-heads", "3"], "--kv-heads (3) must divide"),
    (["--lr", "nan"], "--lr must be a finite positive"), (["--lr", "-1"], "--lr must be a finite positive"),
    (["--backend", "bogus"], "--backend must be one of"), (["--runs", "sdpa,sdpa"], "distinct names"),
    (["--block-size", "24", "--backend", "triton"], "must be a multiple of 16"),
    (["--seq-len", str(10**11)], "is invalid"), (["--out", "{file}"], "--out must name a folder"),
])
def test_cpu_smoke_demo_refuses_bad_flags_in_one_line(flags, words, tmp_path, capsys):
    """Found by the seventeenth probe: these failed deep inside transformers, torch or the optimiser, after
    the work, or ran nonsense (no layers, one run twice)."""
    sys.path.insert(0, str(ROOT / "demos"))
    try:
        import hf_long_context
    finally:
        sys.path.pop(0)
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as stop:
        hf_long_context.main(["--cpu-smoke", *[f.format(file=tmp_path / "file") for f in flags]])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and err.startswith("hf_long_context.py: error:") and words in err, err


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("spec, error", [
    ({"pattern": "bigbirdd"}, r"config.sparse_flash\['pattern'\] must be a name in"),
    ({"pattern": "local", "windw": 1}, r"pattern 'local' takes the parameters \['causal', 'window'\].*'windw'"),
    ({"pattern": "local", "seq_len": 4}, r"must not set 'seq_len'"),
    ({"pattern": "random"}, r"pattern 'random' needs \['density'\]"),
    ({"pattern": "local", "block_size": 100}, r"config.sparse_flash\['block_size'\] must be a multiple of 16"),
    ({"pattern": "local", "block_size": 0, "backend": "torch"}, r"config.sparse_flash\['block_size'\]"),
    ({"pattern": "longformer", "block_size": 64, "global_block_indices": [8]},
     r"config.sparse_flash = .* does not fit 256 tokens \(4 blocks of 64\)"),
    ({"pattern": "local", "backend": "cuda"}, r"config.sparse_flash\['backend'\] must be one of"),
    ({"pattern": "random", "density": 0.5, "num_heads": 3},
     r"mask of 3 heads .* set config.sparse_flash\['num_heads'\]"),
    ({"pattern": "random", "density": 0.5, "seed": torch.Generator()}, r"config.sparse_flash\['seed'\] must be an int"),
    ({"pattern": lambda n, device: masks.local(n // 2, 64)}, r"callable\) must return a mask of lengths \(256, 256\)"),
    ("bigbird", r"config.sparse_flash must be a dict"),
], ids=["unknown-pattern", "unknown-parameter", "geometry-parameter", "missing-parameter", "block-not-16",
        "block-zero", "pattern-needs-more-blocks", "backend", "heads", "generator-seed", "callable-lengths",
        "not-a-dict"])
def test_bad_config_names_the_field(spec, error):
    _, ours = pair("llama", spec)
    with pytest.raises((ValueError, TypeError), match=error):
        ours(tokens(1, 256))


def test_output_attentions_and_attention_dropout_are_refused():
    _, ours = pair("llama", None)
    with pytest.raises(ValueError, match="output_attentions=True: sparse_flash never materialises"):
        ours(tokens(1, 64), output_attentions=True)
    _, bert = pair("bert", None, attention_probs_dropout_prob=0.1)
    bert.train()
    with pytest.raises(ValueError, match=r"attention dropout 0.1 \(config.attention_dropout, "
                                         r"attention_probs_dropout_prob"):
        bert(tokens(1, 64))


@pytest.mark.parametrize("seq_len, device, error", [
    (100.9, None, (TypeError, "seq_len must be an int, got float 100.9")),
    ("100", None, (TypeError, "seq_len must be an int, got str")),
    (True, None, (TypeError, "seq_len must be an int, got bool")),
    (0, None, (ValueError, "seq_len must be at least 1, got 0")),
    (128, "tpu", (ValueError, "device must name a torch device")),
    (128, 3.5, (TypeError, "device must be a torch.device, a str or an int, got float")),
    (128, "meta", (ValueError, "cannot live on the meta device")),
], ids=["float", "str", "bool", "zero", "device-name", "device-type", "meta"])
def test_prepare_checks_its_arguments(seq_len, device, error):
    from types import SimpleNamespace

    config = SimpleNamespace(sparse_flash={"pattern": "local", "block_size": 64, "window": 1})
    with pytest.raises(error[0], match=error[1]):
        prepare(config, seq_len, device)


def test_prepared_4d_mask_is_refused():
    _, ours = pair("llama", None)
    with pytest.raises(ValueError, match="a prepared 4-D element mask is not expressible"):
        ours(tokens(1, 64), attention_mask=torch.ones(1, 1, 64, 64, dtype=torch.bool))


def test_sliding_windows_are_refused():
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=64)
    mistral = transformers.MistralForCausalLM._from_config(config, attn_implementation=NAME)
    with pytest.raises(ValueError, match=r"sliding window of 64 tokens .* set config.sliding_window = None"):
        mistral(tokens(1, 128))
    mistral.config.sliding_window = None  # the documented fix: no window, or the 'local' pattern
    mistral(tokens(1, 128))
    _, modernbert = pair("modernbert", None, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match=r"config.layer_types entry 'full_attention'"):
        modernbert(tokens(1, 128))
    _, modernbert = pair("modernbert", None, layer_types=["sliding_attention", "sliding_attention"])
    window = modernbert.config.sliding_window  # the message quotes the config's window, not the model's kwarg
    with pytest.raises(ValueError, match=rf"sliding window of {window} tokens"):
        modernbert(tokens(1, 128))


def test_cross_attention_is_dense_only():
    changes = dict(is_decoder=True, add_cross_attention=True)
    sdpa, ours = pair("bert", None, **changes)
    ids, memory = tokens(1, 64), torch.randn(1, 96, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = sdpa(ids, encoder_hidden_states=memory).logits
        torch.testing.assert_close(ours(ids, encoder_hidden_states=memory).logits, expected, rtol=1e-5, atol=1e-5)
        one = ids[:, :1]  # one query and no encoder mask: still cross attention, not a decoding step
        torch.testing.assert_close(ours(one, encoder_hidden_states=memory).logits,
                                   sdpa(one, encoder_hidden_states=memory).logits, rtol=1e-5, atol=1e-5)
        ours.config.sparse_flash = LOCAL
        with pytest.raises(ValueError, match=r"config.sparse_flash sets a pattern but this layer attends 64 queries to "
                                             r"96 other keys \(cross attention\)"):
            ours(ids, encoder_hidden_states=memory, encoder_attention_mask=torch.ones(1, 96))
        with pytest.raises(ValueError, match=r"attends 1 queries to 96 other keys"):
            ours(one, encoder_hidden_states=memory)


# ---------------------------------------------------------------------------------------------- GPU


@GPU
@pytest.mark.parametrize("spec, keep", [
    (None, None), ({"pattern": "bigbird", "block_size": 128, "num_heads": 4}, None),
    ({"pattern": "butterfly", "block_size": 64}, None), ({"pattern": "butterfly", "block_size": 64},
                                                         keep_mask(2, 2048, right=(0, 1000))),
], ids=["dense", "bigbird", "butterfly", "butterfly-right-padding"])
def test_gpu_bf16_matches_sdpa(spec, keep):
    check_against_sdpa("llama", spec, 2048, batch=2, keep=keep, dtype=torch.bfloat16, device="cuda", hidden_size=256,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)


@GPU
def test_gpu_generate_dense_matches_sdpa():
    sdpa, ours = (m.to("cuda") for m in pair("llama", None))
    ids, keep = tokens(2, 300).cuda(), keep_mask(2, 300, left=(0, 45)).cuda()
    kwargs = dict(attention_mask=keep, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), sdpa.generate(ids, **kwargs))
