"""bench.rounds without servers: --pool (the rounds of several result files as one result), and
--base-commit's plan (the arguments, the sides, their order) and its git worktree."""

from __future__ import annotations

import json
import subprocess

import pytest

from bench.ceiling import prompts
from bench.rounds import check, label, markdown, parser, plan, pool, resolve_commit, schedule, tree_label, worktree

pytestmark = pytest.mark.unit


def result(tps_a: list[float], tps_b: list[float], a: str = "vllm serve", b: str = "servectl") -> dict:
    def rnd(tps: float) -> dict:
        return {"stream": {"1": {"output_throughput": tps, "median_itl_ms": 1000 / tps}},
                "non_stream_c16": {"tok_s": tps * 10}}

    return {"date": "2026-12-01 00:00", "machine": {"cores": 2, "cpu": "x"}, "rounds": len(tps_a),
            "params": {"input_len": 32, "output_len": 64},
            "raw": {a: [rnd(t) for t in tps_a], b: [rnd(t) for t in tps_b]}}


def test_pooled_medians_are_over_every_round_of_every_file(tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text(json.dumps(result([100, 110, 120], [90, 95, 300])))
    two.write_text(json.dumps(result([130, 140], [200, 210])))
    res, a, b = pool([one, two])
    assert (a, b, res["rounds"]) == ("vllm serve", "servectl", 5)
    assert res["summary"][a]["stream"]["1"]["output_throughput"] == {"median": 120, "min": 100, "max": 140}
    assert res["summary"][b]["stream"]["1"]["output_throughput"] == {"median": 200, "min": 90, "max": 300}
    assert res["summary"][b]["non_stream_c16_tok_s"]["median"] == 2000
    md = markdown(res, a, b)
    assert "5 alternating rounds" in md and "| stream tok/s, c=1 | 120 [100 – 140] | 200 [90 – 300] | 1.67 |" in md


def test_the_ceiling_pools_and_each_server_gets_its_share(tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text(json.dumps({**result([100, 110], [90, 95]), "ceiling": [{"1": {"tok_s": 200.0}},
                                                                             {"1": {"error": "exit 1"}}]}))
    two.write_text(json.dumps({**result([120], [100]), "ceiling": [{"1": {"tok_s": 220.0}}, {"1": {"tok_s": 180.0}}]}))
    res, a, b = pool([one, two])
    assert res["summary"]["ceiling"] == {"1": {"median": 200.0, "min": 180.0, "max": 220.0}}  # the failed one left out
    md = markdown(res, a, b)
    assert "| 1 | 200 [180 – 220] | 0.55 | 0.47 |" in md, md
    # Without a ceiling in every file, none is claimed.
    two.write_text(json.dumps(result([120], [100])))
    res, a, b = pool([one, two])
    assert "ceiling" not in res["summary"] and "in-process" not in markdown(res, a, b)


def test_ceiling_prompts_are_seeded_random_tokens_inside_the_vocabulary():
    first, again = prompts(3, 32, 1000), prompts(3, 32, 1000)
    assert first == again and len(first) == 3 and all(len(p) == 32 for p in first)
    assert all(100 <= t < 900 for p in first for t in p) and first[0] != first[1]
    assert prompts(1, 32, 1000, seed=1) != prompts(1, 32, 1000)


def test_files_of_other_servers_are_not_pooled(tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text(json.dumps(result([100], [90])))
    two.write_text(json.dumps(result([100], [90], a="servectl A", b="servectl B")))
    with pytest.raises(SystemExit, match="different servers"):
        pool([one, two])


# ---- --base-commit: one side from a git worktree of another commit --------------------------------

def test_base_commit_plans_the_commit_against_this_tree_alternating(tmp_path):
    p = parser().parse_args(["--base-commit", "abc", "--rounds", "2", "--env-a", "K=1", "--engine-arg-b", "x=true"])
    check(p)
    a, b = plan(p, base_code=tmp_path, base_commit="0123456789abcdef", tree="fedcba9876+dirty")
    assert (a.name, a.kind, a.code, a.commit, a.env) == ("servectl@0123456789", "servectl", tmp_path,
                                                        "0123456789abcdef", {"K": "1"})
    assert (b.name, b.code, b.commit, b.engine_args) == ("servectl@fedcba9876+dirty", None, None, {"x": "true"})
    assert [(i, s.name) for i, s in schedule(2, (a, b))] == [(0, a.name), (0, b.name), (1, a.name), (1, b.name)]
    assert label(a.name) == "servectl-0123456789" and label(b.name) == "servectl-fedcba9876-dirty"


def test_without_a_base_commit_the_sides_are_as_before():
    a, b = plan(parser().parse_args([]))
    assert (a.name, a.kind, b.name, b.kind, b.code) == ("vllm serve", "vllm", "servectl", "servectl", None)
    a, b = plan(parser().parse_args(["--only", "servectl", "--env-a", "A=1", "--env-b", "B=2"]))
    assert (a.name, a.env, b.name, b.env) == ("servectl A", {"A": "1"}, "servectl B", {"B": "2"})
    assert (label(a.name), label(b.name)) == ("servectl-A", "servectl-B")


@pytest.mark.parametrize("argv, needle", [
    (["--base-commit", "x", "--pool", "a.json"], "one or the other"),
    (["--base-commit", "x", "--only", "servectl"], "drop --only"),
    (["--rounds", "0"], "at least 1"),
    (["--env-a", "NOEQUALS"], "K=V"),
])
def test_contradictory_arguments_are_refused(argv, needle):
    with pytest.raises(SystemExit, match=needle):
        check(parser().parse_args(argv))


def test_the_worktree_holds_the_commit_and_goes_away(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()

    def g(*args):
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              check=True, capture_output=True, text=True).stdout.strip()

    g("init", "-q")
    (repo / "f.txt").write_text("old\n")
    g("add", "f.txt")
    g("commit", "-q", "-m", "old")
    old = g("rev-parse", "HEAD")
    (repo / "f.txt").write_text("new\n")
    g("commit", "-q", "-am", "new")
    assert resolve_commit(old[:7], repo) == old
    with pytest.raises(SystemExit, match="not a commit"):
        resolve_commit("no-such-rev", repo)
    assert tree_label(repo) == g("rev-parse", "--short=10", "HEAD")
    (repo / "f.txt").write_text("edited\n")
    assert tree_label(repo).endswith("+dirty")
    with worktree(old, repo) as path:
        assert (path / "f.txt").read_text() == "old\n"
        assert str(path) in g("worktree", "list")
    assert not path.exists() and str(path) not in g("worktree", "list")
    assert (repo / "f.txt").read_text() == "edited\n"  # this tree untouched


def test_repeat_prompts_hold_their_text_twice_and_start_it_a_third_time(tmp_path):
    from bench.rounds import repeat_dataset

    lines = [json.loads(ln)["prompt"] for ln in repeat_dataset(tmp_path / "r.jsonl", count=40).read_text().splitlines()]
    assert len(lines) == 40 and len(set(lines)) == 40
    for prompt in lines:
        chunk, again, start = prompt.split("\n\n")
        assert chunk == again and chunk.startswith(start) and len(chunk) <= 360


def test_a_speculative_config_reaches_both_servers_as_they_spell_it():
    from bench.rounds import toml_inline

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    import tomllib

    assert tomllib.loads(f"x = {toml_inline(spec)}")["x"] == spec
    p = parser().parse_args(["--speculative-config", json.dumps(spec), "--repeat-prompts", "--early"])
    assert json.loads(p.speculative_config) == spec and p.repeat_prompts and p.early
