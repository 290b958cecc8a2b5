from copse.cli import main

main()
