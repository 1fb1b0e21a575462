"""The pieces of the GPT examples that need no mesh: tokenizer, batches, model, PNG line plots."""

import os
import struct
import sys
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from gpt import GPT, CharTokenizer, GPTConfig, batch_offsets, get_batch, load_corpus  # noqa: E402
from lineplot import BLUE, Canvas, draw_line_plot, save_line_plot  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: more torch threads only spin against the other processes on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- corpus and tokenizer -----------------------------------------------------------------------
def test_corpus_shipped_and_tokenizable():
    text = load_corpus()
    assert 15_000 < len(text) < 100_000
    tok = CharTokenizer(text)
    assert 30 <= tok.vocab_size <= 100
    assert tok.decode(tok.encode(text)) == text


@given(st.text(min_size=1, max_size=200))
def test_tokenizer_round_trip(text):
    tok = CharTokenizer(text)
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids, dtype=torch.int64)) == text


def test_tokenizer_errors():
    tok = CharTokenizer("abc")
    with pytest.raises(ValueError, match="'z' is not in the tokenizer's vocabulary"):
        tok.encode("az")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match="non-empty"):
        CharTokenizer("")


# ---- batches ------------------------------------------------------------------------------------
@settings(max_examples=30)
@given(st.integers(10, 300), st.integers(1, 8), st.integers(1, 6), st.integers(0, 2**31))
def test_get_batch_matches_slicing(n, block, batch, seed):
    if n < block + 1:
        with pytest.raises(ValueError, match="too short"):
            batch_offsets(n, block, batch, torch.Generator().manual_seed(seed))
        return
    data = torch.randint(0, 50, (n,))
    offs = batch_offsets(n, block, batch, torch.Generator().manual_seed(seed))
    assert offs.shape == (batch,) and offs.dtype == torch.int64
    x, y = get_batch(data, offs, block)
    assert x.shape == y.shape == (batch, block)
    for b, o in enumerate(offs.tolist()):
        assert 0 <= o and o + block < n
        assert torch.equal(x[b], data[o:o + block])
        assert torch.equal(y[b], data[o + 1:o + block + 1])


def test_batch_offsets_reproducible_and_shaped():
    a = batch_offsets(1000, 16, 4, torch.Generator().manual_seed(3), shape=(5, 2))
    b = batch_offsets(1000, 16, 4, torch.Generator().manual_seed(3), shape=(5, 2))
    assert a.shape == (5, 2, 4) and torch.equal(a, b)
    with pytest.raises(ValueError, match="1-D"):
        get_batch(torch.arange(100), a, 16)


# ---- model --------------------------------------------------------------------------------------
def test_gpt_shapes_causality_and_learning():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16)
    model = GPT(cfg)
    assert model.lm_head.weight is model.wte.weight
    assert model.num_params() == sum(p.numel() for p in set(model.parameters()))
    x = torch.randint(0, 11, (3, 8))
    logits, loss = model(x)
    assert logits.shape == (3, 8, 11) and loss is None
    # causal: changing the last token changes no earlier position's logits
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % 11
    assert torch.allclose(model(x2)[0][:, :-1], logits[:, :-1], atol=1e-6)
    assert not torch.allclose(model(x2)[0][:, -1], logits[:, -1])
    # it can overfit one batch
    y = torch.randint(0, 11, (3, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = model(x, y)[1].item()
    for _ in range(60):
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
    assert model(x, y)[1].item() < 0.5 * first
    with pytest.raises(ValueError, match="longer than block_size"):
        model(torch.zeros(1, 9, dtype=torch.int64))
    out = model.generate(x[:1, :2], 10, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 12) and torch.equal(out[:, :2], x[:1, :2])


def test_gpt_config_errors():
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig(n_embd=10, n_head=4)
    with pytest.raises(ValueError, match="n_layer must be >= 1"):
        GPTConfig(n_layer=0)


# ---- PNG ----------------------------------------------------------------------------------------
def decode_png(data: bytes):
    """A minimal PNG reader for 8-bit RGB, filter 0 (what lineplot writes): (width, height, rows)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body), f"bad CRC in {kind}"
        chunks.append((kind, body))
        pos += 12 + n
    assert [k for k, _ in chunks][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    w, h, depth, color, _, _, _ = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    assert len(raw) == h * (3 * w + 1)
    rows = [raw[y * (3 * w + 1):(y + 1) * (3 * w + 1)] for y in range(h)]
    assert all(r[0] == 0 for r in rows)
    return w, h, [r[1:] for r in rows]


def test_png_encodes_canvas_exactly():
    c = Canvas(7, 5)
    c.line(0, 0, 6, 4, BLUE)
    w, h, rows = decode_png(c.png())
    assert (w, h) == (7, 5)
    for y in range(5):
        for x in range(7):
            assert tuple(rows[y][3 * x:3 * x + 3]) == c.get(x, y)
    assert c.get(0, 0) == BLUE and c.get(6, 4) == BLUE and c.get(6, 0) == (255, 255, 255)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=50))
def test_line_plot_draws_every_point(ys):
    c = draw_line_plot(ys, width=200, height=120, title="loss", xlabel="step")
    left, right, top, bottom = 70, 180, 40, 75
    lo, hi = min(ys), max(ys)
    for i, v in enumerate(ys):  # a blue pixel where each point lands
        x = left + (i / (len(ys) - 1) if len(ys) > 1 else 0.5) * (right - left)
        y = bottom - ((v - lo) / (hi - lo) if hi > lo else 0.5) * (bottom - top)
        near = [c.get(px, py) for px in range(round(x) - 1, round(x) + 2) for py in range(round(y) - 1, round(y) + 2)]
        assert BLUE in near, (i, v)


def test_save_line_plot_builtin(tmp_path):
    path = tmp_path / "loss.png"
    assert save_line_plot(str(path), [4.0, 3.0, 2.5, 2.4], title="train loss", xlabel="step", backend="builtin") == "builtin"
    w, h, rows = decode_png(path.read_bytes())
    assert (w, h) == (640, 400)
    assert sum(bytes(rows[y]).count(bytes(BLUE)) for y in range(h)) > 100  # the curve is there
    with pytest.raises(ValueError, match="non-finite"):
        save_line_plot(str(path), [1.0, float("nan")], backend="builtin")
    with pytest.raises(ValueError, match="empty"):
        save_line_plot(str(path), [], backend="builtin")
    with pytest.raises(ValueError, match="backend"):
        save_line_plot(str(path), [1.0], backend="svg")
