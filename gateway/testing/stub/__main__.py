from gateway.testing.stub.cli import main

main()
