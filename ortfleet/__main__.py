from ortfleet.cli import main

main()
