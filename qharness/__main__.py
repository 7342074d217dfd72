from qharness.cli.main import main

main()
