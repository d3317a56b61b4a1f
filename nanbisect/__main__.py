from nanbisect.cli import main

main()
