from qharness.cli.main import console

console()
