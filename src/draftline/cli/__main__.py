from draftline.cli import main

main()
