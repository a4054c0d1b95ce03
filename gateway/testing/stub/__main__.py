from gateway.testing.stub.app import main

main()
