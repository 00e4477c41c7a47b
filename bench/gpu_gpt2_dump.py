import os, torch, ember
from transformers import GPT2Config, GPT2LMHeadModel
model = GPT2LMHeadModel(GPT2Config()).cuda().train()
ids = torch.randint(0, 50257, (8, 256), device="cuda")
fn = ember.compile(model)
for _ in range(2):
    fn(input_ids=ids, labels=ids).loss.backward()
torch.cuda.synchronize()
