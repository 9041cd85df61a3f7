"""Every Python block of the README and the documentation runs, as a reader would paste it, against
the shipped model: a page's blocks in order, in a fresh interpreter and an empty folder
(``tests/doc_blocks.py``). Blocks marked as needing vLLM run in the vLLM suite; those needing a GPU
are only counted."""

import pytest

from tests.doc_blocks import ROOT, pages, python_blocks, run_blocks

PAGES = {str(path.relative_to(ROOT)): python_blocks(path) for path in pages()}
RUN_HERE = {page: [b for b in blocks if b.requires is None] for page, blocks in PAGES.items()}
NEED_VLLM = [b for blocks in PAGES.values() for b in blocks if b.requires == "vllm"]


@pytest.mark.slow
@pytest.mark.parametrize("page", [page for page, blocks in RUN_HERE.items() if blocks])
def test_the_pages_python_blocks_run(page, tmp_path):
    output = run_blocks(RUN_HERE[page], tmp_path)
    assert output.count("\nran ") + output.startswith("ran ") == len(RUN_HERE[page]), output


@pytest.mark.vllm
@pytest.mark.slow
def test_the_blocks_that_need_vllm_run(tmp_path):
    assert NEED_VLLM, "no block is marked <!-- requires: vllm -->: drop this test or mark one"
    for page in dict.fromkeys(block.page for block in NEED_VLLM):
        blocks = [b for b in PAGES[page] if b.requires in (None, "vllm")]
        folder = tmp_path / page.replace("/", "_")
        folder.mkdir()
        run_blocks(blocks, folder)


def test_blocks_are_found_on_the_pages_that_teach_with_code():
    """The collector reads the pages it should: the README's stepping example and the guides' blocks."""
    assert len(RUN_HERE["README.md"]) == 2
    assert sum(len(blocks) for blocks in PAGES.values()) >= 20
    assert all(block.requires in (None, "vllm", "gpu") for blocks in PAGES.values() for block in blocks)
