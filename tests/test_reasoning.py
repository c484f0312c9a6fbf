"""``kvpool.server.reasoning``: a thinking model's reply into reasoning and content, whole
or streamed in any pieces."""

from __future__ import annotations

import random

import pytest

from kvpool.server.reasoning import ThinkSplit, openai_think, thinks

CASES = [
    # (reply, prompt opened the block, reasoning, content)
    ("<think>\nLet me see.\n</think>\n\nIt is 4.", False, "Let me see.\n", "It is 4."),
    ("<think>\n\n</think>\n\nHi!", False, "", "Hi!"),
    ("Plain <think>not reasoning</think>", False, "", "Plain <think>not reasoning</think>"),
    ("  \n<think>a < b </thin k></think>done", False, "a < b </thin k>", "done"),
    ("from the prompt's block</think>\n\nanswer", True, "from the prompt's block", "answer"),
    ("<think>never closed, cut by max_tokens", False, "never closed, cut by max_tokens", ""),
    ("still thinking </th", True, "still thinking </th", ""),
    ("<thin", False, "", "<thin"),
    ("", False, "", ""),
    ("</think>answer", True, "", "answer"),
]  # fmt: skip


@pytest.mark.parametrize("reply, inside, reasoning, content", CASES)
def test_a_reply_splits_the_same_whole_or_in_any_pieces(reply, inside, reasoning, content):
    assert ThinkSplit.split(reply, inside) == (reasoning, content)
    rng = random.Random(len(reply))
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(reply) + 1), min(len(reply) + 1, rng.randrange(1, 9))))
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)], strict=True)]
        splitter = ThinkSplit(inside)
        got = [splitter.feed(p) for p in pieces] + [splitter.finish()]
        assert "".join(t for t, _ in got) == reasoning, pieces
        assert "".join(c for _, c in got) == content, pieces


def test_a_tag_is_held_back_until_the_text_decides_it():
    splitter = ThinkSplit()
    assert splitter.feed("<thi") == ("", "")
    assert splitter.feed("nk>I wonder</th") == ("I wonder", "")
    assert splitter.feed("ink>\n\nYes") == ("", "Yes")
    assert splitter.finish() == ("", "")


def test_which_templates_think_and_the_openai_switches():
    assert thinks("{{ '<think>\\n' }}...{{ '</think>' }}") and not thinks("<|im_start|>")

    class Body:
        def __init__(self, kwargs=None, effort=None):
            self.chat_template_kwargs, self.reasoning_effort = kwargs, effort

    assert openai_think(Body()) is None
    assert openai_think(Body({"enable_thinking": False}, "high")) is False
    assert openai_think(Body(effort="none")) is False and openai_think(Body(effort="low")) is True
    for bad in (Body({"enable_thinking": "no"}), Body(effort="max")):
        with pytest.raises(Exception, match=r"enable_thinking|reasoning_effort"):
            openai_think(bad)
