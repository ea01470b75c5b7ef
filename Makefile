.PHONY: setup demo test test-fast
setup:
	bash scripts/setup.sh
demo: setup
	.venv/bin/specgrammar demo
test: setup
	bash scripts/test.sh
# the inner loop: the core, the laws, the engines and each adapter's smoke test (tests marked slow left out), on two
# workers (it holds no vLLM server and few engines, so two fit in 24 GB)
test-fast: setup
	SPECGRAMMAR_TEST_WORKERS=$${SPECGRAMMAR_TEST_WORKERS:-2} bash scripts/test.sh -m "not slow"
