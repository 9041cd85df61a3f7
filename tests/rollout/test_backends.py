"""Generation backends are picked by name from TRL's fields."""

from types import SimpleNamespace

from grpo_lab.rollout import BACKENDS, backend_name


def test_trl_fields_pick_a_registered_backend_by_name():
    picks = {
        (False, "colocate"): "transformers",
        (False, "server"): "transformers",  # vllm_mode means nothing without use_vllm
        (True, "colocate"): "vllm-colocate",
        (True, "server"): "vllm-server",
    }
    for (use_vllm, mode), name in picks.items():
        assert backend_name(SimpleNamespace(use_vllm=use_vllm, vllm_mode=mode)) == name
    assert set(picks.values()) == set(BACKENDS)


def test_the_session_generates_with_the_backend_its_config_names(make_session):
    session = make_session()
    assert session.engine.rollout_backend.name == "transformers"


def test_transformers_generation_stops_at_a_stop_string(make_session):
    # model.generate matches stop_strings on text, so it needs the tokenizer passed along
    session = make_session(max_completion_length=16, generation_kwargs={"stop_strings": ["</answer>"]})
    rollout = session.generate()
    for text in rollout.completion_texts:
        assert "</answer>" not in text or text.endswith("</answer>")  # nothing generated after the stop string
