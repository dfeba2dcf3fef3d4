from grpo_jax.aot.analyze import main

if __name__ == "__main__":
    main()
