from grpo_jax.aot.cli import main

if __name__ == "__main__":
    main()
