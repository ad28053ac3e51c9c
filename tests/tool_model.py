"""A tiny model that really calls a tool, built in seconds: for the `sluice up` test of
``environment.tools`` (tests/e2e/test_up_tools.py).

A random tiny model never writes a call that parses, so the tool loop would never run.
`build_tool_model` makes one that does: a tiny Qwen2 with Qwen2.5's chat template (the
one TRL ships, which renders tools, calls and tool messages) and a byte-level BPE
tokenizer trained on the episodes it will play, then taught by plain supervised
next-token loss to play them. For ``"What is 2 plus 3?"`` the episode is

    <the prompt, the add tool's schema in the system turn><|im_start|>assistant\\n
    <tool_call>\\n{"name": "add", "arguments": {"a": 2, "b": 3}}\\n</tool_call><|im_end|>
    \\n<|im_start|>user\\n<tool_response>\\n5\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
    5<|im_end|>

The training sequences are cut into the very segments the environment runner inserts
(`workers.environments.runner`: the prompt without the generation prompt, the opening,
the model's turn, the tool message's rendering) and tokenised segment by segment as the
runner does, so what the model memorises is token for token what the generator feeds
it; the loss covers the model's turns only (the runner's mask 1). The call is learnt
until it is near certain; after the tool result the model answers the sum or the sum
plus one, half and half (each is a training sequence), so the reward
(``examples.tools_fns:final_answer_reward``: the final answer is the sum) varies within
a group and the trainer gets non-zero advantages to train on. A symmetric choice stays
half and half at any sampling temperature, while a low one makes the call all but
certain: no failed call.

The tokenizer does not split on whitespace (``use_regex=False``), so BPE merges whole
phrases of the template and the tools' system turn: an episode is tens of tokens, not
the ~900 bytes it renders to, and the model trains in seconds on a CPU.

`add` is the tool (named by ``environment.tools = ["tests.tool_model:add"]``); `PAIRS`
are the prompts' operands, written by `write_prompts` as a ``jsonl`` task.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PAIRS = [(2, 3), (4, 1), (1, 6), (3, 4)]
"""The operands of the training prompts (a different first operand each: memorised in
about a hundred steps)."""
HELDOUT = (9, 4)
"""The one held-out prompt's operands: ``task.heldout``'s hash split (5%) puts "What is
9 plus 4?" on the held-out side and every `PAIRS` prompt on the training side
(`write_prompts` checks it). The model never saw it."""

TOOL = "tests.tool_model:add"
CALL = '<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def question(a: int, b: int) -> str:
    return f"What is {a} plus {b}?"


def write_prompts(path: Path) -> Path:
    """`PAIRS` and `HELDOUT` as a ``jsonl`` task file (``prompt``, ``answer`` columns);
    asserts the task splits it as `HELDOUT` says."""
    from workers.tasks.data import JsonlTask

    path.write_text("".join(json.dumps({"prompt": question(a, b), "answer": str(a + b)}) + "\n"
                            for a, b in [*PAIRS, HELDOUT]))
    task = JsonlTask(path)
    assert [task.prompt(i)["text"] for i in range(len(task))] == [question(*p) for p in PAIRS]
    assert [p["text"] for p in task.heldout(8)] == [question(*HELDOUT)]
    return path


def qwen25_template() -> str:
    """Qwen2.5's chat template as TRL ships it (renders tools, tool_calls, tool messages)."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()


def _tokenizer(texts: list[str], template: str, vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    tok.chat_template = template
    return tok


def episode_segments(tok: Any, a: int, b: int, schemas: list[dict[str, Any]],
                     answer: int | None = None) -> list[tuple[list[int], bool]]:
    """One episode as the runner builds it, (token ids, a model turn?) per segment: the
    prompt, the opening, the call, the tool result, the answer (default: the sum)."""
    from workers.environments.runner import episode_prompt, observation_ids, opening_text

    eos = tok.eos_token_id
    prompt_ids, conv = episode_prompt(tok, question(a, b), "", tools=schemas)
    assert conv is not None
    ids = lambda text: list(tok(text, add_special_tokens=False).input_ids)  # noqa: E731
    tool_msg = [{"role": "tool", "name": "add", "content": str(add(a, b))}]
    return [(prompt_ids, False),
            (ids(opening_text(tok, conv, None, role="tool", tools=schemas)), False),
            ([*ids(CALL.format(a=a, b=b)), eos], True),
            (observation_ids(tok, tool_msg, role="tool", after_eos=True, tools=schemas), False),
            ([*ids(str(add(a, b) if answer is None else answer)), eos], True)]


def _batch(episodes: list[list[tuple[list[int], bool]]], pad: int) -> tuple[Any, Any, Any]:
    """Right-padded input ids, attention mask and labels (-100 outside the model's turns)."""
    import torch

    width = max(sum(len(s) for s, _ in e) for e in episodes)
    x = torch.full((len(episodes), width), pad)
    labels = torch.full((len(episodes), width), -100)
    attn = torch.zeros((len(episodes), width), dtype=torch.long)
    for r, e in enumerate(episodes):
        at = 0
        for seg, trained in e:
            x[r, at:at + len(seg)] = torch.tensor(seg)
            if trained:
                labels[r, at:at + len(seg)] = torch.tensor(seg)
            at += len(seg)
        attn[r, :at] = 1
    return x, attn, labels


def _nll(model: Any, x: Any, attn: Any, labels: Any) -> Any:
    """Per-position negative log-likelihood of ``labels`` (0 where not trained)."""
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=x, attention_mask=attn).logits[:, :-1], -1)
    tgt = labels[:, 1:]
    nll = -logp.gather(-1, tgt.clamp(min=0)[..., None])[..., 0]
    return torch.where(tgt == -100, torch.zeros_like(nll), nll)


def build_tool_model(out: Path, *, max_steps: int = 1500, call_nll: float = 0.02,
                     seed: int = 0) -> Path:
    """The model folder (module docstring) at ``out``: weights, tokenizer, Qwen2.5's chat
    template. Trains (AdamW, full batch) until every token of the call turns has a
    probability above ``exp(-call_nll)`` and each first answer token one in [0.3, 0.7]
    (the two answers about even), then asserts that greedy decoding writes every `PAIRS`
    call exactly and answers one of the two."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from workers.environments.tools import load_tools

    template = qwen25_template()
    schemas = [t.schema for t in load_tools([TOOL])]
    # the texts the runner will render, through a throwaway byte tokenizer's template
    probe = _tokenizer(["x"], template, 300)
    texts = [probe.decode([i for seg, _ in episode_segments(probe, a, b, schemas, c)
                           for i in seg]) for a, b in PAIRS for c in (a + b, a + b + 1)]
    tok = _tokenizer(texts * 4, template, 1000)
    episodes = [episode_segments(tok, a, b, schemas, c)
                for a, b in PAIRS for c in (a + b, a + b + 1)]
    assert [tok.decode([i for s, _ in e for i in s]) for e in episodes] == texts
    starts = [sum(len(s) for s, _ in e[:4]) for e in episodes]  # of the answer turn

    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None, dtype="float32")
    x, attn, labels = _batch(episodes, tok.pad_token_id)
    call = (labels != -100)
    for r, at in enumerate(starts):
        call[r, at:] = False  # the call turns only
    call = call[:, 1:]
    first = torch.tensor(starts) - 1  # where the first answer token is predicted
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        learned, worst, even = False, float("nan"), []
        for step in range(1, max_steps + 1):
            loss = model(input_ids=x, attention_mask=attn, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 10 == 0:
                nll = _nll(model, x, attn, labels)
                worst = float(nll[call].max())
                even = torch.exp(-nll[torch.arange(len(starts)), first]).tolist()
                if learned := worst < call_nll and all(0.3 < p < 0.7 for p in even):
                    break
    assert learned, f"not learnt in {max_steps} steps: call nll {worst:.4f}, answers {even}"
    model.eval()
    for e in episodes[::2]:  # greedy: each call exactly, then one of the two answers
        context: list[int] = []
        for k, (seg, _) in enumerate(e):
            if k in (2, 4):
                got = model.generate(torch.tensor([context]), max_new_tokens=len(seg) + 2,
                                     do_sample=False, eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.pad_token_id)[0, len(context):]
                text = tok.decode(got, skip_special_tokens=True)
                want = tok.decode(seg, skip_special_tokens=True)
                assert (text == want if k == 2 else text in (want, str(int(want) + 1))), \
                    (text, want)
            context += seg
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
