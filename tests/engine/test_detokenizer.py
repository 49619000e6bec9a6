import pytest

from ferry.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(smollm):
    return smollm[1]


@pytest.mark.parametrize(
    "text", ["Hello, world! How are you?", "naïve café – 😀 emoji 🚀 and 中文字符", "  two  spaces\nnew line"]
)
def test_incremental_equals_full_decode(tok, text):
    prompt = tok.encode("Say:")
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, prompt, stop=[])
    pieces = []
    for t in ids:
        d.add_token(t)
        pieces.append(d.delta(finished=False))
    pieces.append(d.delta(finished=True))
    assert "".join(pieces) == tok.decode(ids) == d.text
    assert all("\ufffd" not in p for p in pieces)  # half characters are held back


def test_stop_string_spanning_tokens_and_holdback(tok):
    ids = tok.encode(" alpha beta gamma delta")
    stop = "ta gam"  # ends inside " gamma", starts inside " beta"
    d = IncrementalDetokenizer(tok, [], stop=[stop])
    sent = ""
    hit = None
    for t in ids:
        hit = d.add_token(t)
        if hit:
            break
        sent += d.delta(finished=False)
        assert not sent.endswith("ta ga")  # a possible stop prefix is never sent early
    assert hit == stop
    sent += d.delta(finished=True)
    assert sent == d.text == " alpha be"


def test_include_stop_str(tok):
    d = IncrementalDetokenizer(tok, [], stop=["beta"], include_stop_str_in_output=True)
    for t in tok.encode(" alpha beta gamma"):
        if d.add_token(t):
            break
    assert d.text == " alpha beta"


def test_no_tokenizer_means_no_text():
    d = IncrementalDetokenizer(None, [1, 2], stop=[])
    assert d.add_token(5) is None and d.text == ""


def test_earliest_stop_match_wins_whatever_the_list_order(tok):
    d = IncrementalDetokenizer(tok, [], stop=["ph", "al"])
    hit = None
    for t in tok.encode(" alpha beta"):
        hit = d.add_token(t)
        if hit:
            break
    assert hit == "al" and d.text == " "
