import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "specgrammar_plugins.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_help_and_bench_list():
    r = run("--help")
    assert r.returncode == 0 and "demo" in r.stdout and "check" in r.stdout
    r = run("bench")
    assert r.returncode == 0 and "masks" in r.stdout and "coverage" in r.stdout
    assert run("bench", "nope").returncode == 2


def test_check_reports_engines_and_errors():
    r = run("check", '{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "title": "t"}')
    assert r.returncode == 0, r.stdout + r.stderr
    assert "llguidance" in r.stdout and "enforces" in r.stdout
    assert "minimum" in r.stdout and "ignores (annotations) title" in r.stdout
    assert "default for json_schema (auto: the first of llguidance, xgrammar that compiles it) picks: llguidance" \
        in r.stdout
    r = run("check", '{"oneOf": [{"type": "string"}, {"type": "array", "uniqueItems": true}]}')
    assert "oneOf at /oneOf -> anyOf (branches pairwise disjoint)" in r.stdout
    assert "'uniqueItems' at /oneOf/1/uniqueItems is not enforced by llguidance" in r.stdout
    assert "default for json_schema (auto: the first of llguidance, xgrammar that compiles it): refused" in r.stdout
    r = run("check", "--regex", "[a-z")
    assert r.returncode == 1 and "refused" in r.stdout
