.PHONY: setup demo test test-fast
setup:
	bash scripts/setup.sh
demo: setup
	.venv/bin/specgrammar demo
test: setup
	bash scripts/test.sh
# the inner loop: the core, the laws, the engines and each adapter's smoke test (tests marked slow left out)
test-fast: setup
	bash scripts/test.sh -m "not slow"
