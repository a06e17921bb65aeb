"""Entrypoints and configs: the `dflash` command line, YAML configs per stage, the demo."""
