from openai_frontend.server import main

main()
