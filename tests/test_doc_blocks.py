"""Every Python block of the README and the documentation runs, as a reader would paste it, against
the shipped model: a page's blocks in order, in a namespace and an empty folder of their own
(``tests/doc_blocks.py``). Blocks marked as needing vLLM run in the vLLM suite; those needing a GPU
are not run by the tests."""

import pytest

from tests.doc_blocks import ROOT, pages, python_blocks, run_pages

PAGES = {str(path.relative_to(ROOT)): python_blocks(path) for path in pages()}
RUN_HERE = {page: [b for b in blocks if b.requires is None] for page, blocks in PAGES.items()}
NEED_VLLM = [b for blocks in PAGES.values() for b in blocks if b.requires == "vllm"]


@pytest.fixture(scope="module")
def ran_here(tmp_path_factory):
    """Every page's blocks that run in the main suite, run once for the module."""
    return run_pages({page: blocks for page, blocks in RUN_HERE.items() if blocks}, tmp_path_factory.mktemp("pages"))


@pytest.mark.slow
@pytest.mark.parametrize("page", [page for page, blocks in RUN_HERE.items() if blocks])
def test_the_pages_python_blocks_run(page, ran_here):
    result = ran_here[page]
    assert "error" not in result, f"{page}: a block failed:\n{result.get('error')}"
    assert result["ran"] == [block.label for block in RUN_HERE[page]]


@pytest.mark.vllm
@pytest.mark.slow
def test_the_blocks_that_need_vllm_run(tmp_path):
    assert NEED_VLLM, "no block is marked <!-- requires: vllm -->: drop this test or mark one"
    pages_with_vllm = dict.fromkeys(block.page for block in NEED_VLLM)
    blocks = {page: [b for b in PAGES[page] if b.requires in (None, "vllm")] for page in pages_with_vllm}
    for page, result in run_pages(blocks, tmp_path).items():
        assert "error" not in result, f"{page}: a block failed:\n{result.get('error')}"
        assert result["ran"] == [block.label for block in blocks[page]]


def test_blocks_are_found_on_the_pages_that_teach_with_code():
    """The collector reads the pages it should, fences at the margin and under list items alike."""
    assert RUN_HERE["README.md"] and RUN_HERE["docs/guides/session.md"] and RUN_HERE["docs/guides/port-from-trl.md"]
    assert [block.requires for block in PAGES["docs/guides/vllm.md"]] == ["vllm"]  # indented under a list item


def test_a_marker_must_name_a_known_need_and_a_fence_must_close(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- requires: tpu -->\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="unknown requirement 'tpu'"):
        python_blocks(page, root=tmp_path)
    page.write_text("```python\nx = 1\n")
    with pytest.raises(ValueError, match="never closed"):
        python_blocks(page, root=tmp_path)
    page.write_text("```py\nx = 1\n```\n\n```bash\nls\n```\n")
    assert [block.source for block in python_blocks(page, root=tmp_path)] == ["x = 1\n"]
