from lightning_pipe.command import main

main()
