.PHONY: setup demo test
setup:
	bash scripts/setup.sh
demo: setup
	.venv/bin/specgrammar demo
test: setup
	bash scripts/test.sh
