from grpo_jax.aot.analyze import main

main()
