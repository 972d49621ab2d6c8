"""Dynamic sampling's episode filters and their config keys."""

import pytest

from asyncrl.api import Trajectory
from asyncrl.config import ConfigError, load_config
from asyncrl.controller.rollout import has_reward_signal, make_episode_filter


def group(*rewards):
    return [Trajectory(input_ids=[1, 2], loss_mask=[0, 1], behavior_logprobs=[0.0, -1.0],
                       versions=[-1, 0], reward=r, group_id="g") for r in rewards]


def test_a_group_is_kept_only_if_its_rewards_differ():
    assert has_reward_signal(group(0.0, 1.0, 0.0, 0.0))
    assert has_reward_signal(group(0.5, 0.5000001))
    assert not has_reward_signal(group(1.0, 1.0, 1.0, 1.0))
    assert not has_reward_signal(group(0.0, 0.0))


def keep_long_groups(trajectories):
    """A custom filter for the test below: groups of at least 3."""
    return len(trajectories) >= 3


def test_the_filter_follows_the_config():
    assert make_episode_filter(False, None) is None
    assert make_episode_filter(True, None) is has_reward_signal
    custom = make_episode_filter(True, f"{__name__}:keep_long_groups")
    assert custom(group(1.0, 1.0, 1.0)) and not custom(group(0.0, 1.0))


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "is not 'package.module:function'"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    (f"{__name__}:missing", "has no function 'missing'"),
])
def test_a_bad_filter_name_says_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=f"rollout.dynamic_filter_fn=.*{message}"):
        make_episode_filter(True, spec)


def _load(*overrides):
    return load_config(None, ["train_dataset.path=reasoning_gym:basic_arithmetic", *overrides])


def test_dynamic_sampling_is_off_by_default_and_loads():
    assert not _load().rollout.dynamic_sampling
    cfg = _load("rollout.dynamic_sampling=true", f"rollout.dynamic_filter_fn={__name__}:f")
    assert cfg.rollout.dynamic_filter_fn == f"{__name__}:f"


@pytest.mark.parametrize("overrides, message", [
    (["rollout.dynamic_filter_fn=a.b:c"],
     "rollout.dynamic_filter_fn='a.b:c' is used only with rollout.dynamic_sampling=true"),
    (["rollout.dynamic_sampling=true", "gconfig.n_samples=1"],
     r"a group of gconfig.n_samples=1 always is; raise gconfig.n_samples"),
])
def test_dynamic_sampling_settings_that_cannot_work_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _load(*overrides)


def test_the_documented_dapo_settings_load(tmp_path):
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "guides" / "algorithms.md").read_text()
    section = doc[doc.index("DAPO as settings"):]
    start = section.index("```yaml") + len("```yaml")
    block = section[start:section.index("```", start)]
    path = tmp_path / "dapo.yaml"
    path.write_text(block + "train_dataset: {path: x.jsonl}\ngconfig: {max_new_tokens: 20480}\n")
    cfg = load_config(path)
    assert cfg.rollout.dynamic_sampling and cfg.actor.eps_clip_higher == 0.28
    assert cfg.actor.overlong_reward_penalty and cfg.actor.overlong_tokens == 4096
