from xhpc.cli.main import main

main()
