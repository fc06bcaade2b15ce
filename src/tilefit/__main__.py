from tilefit.cli.app import main

main()
