from qharness.cli import main

main()
